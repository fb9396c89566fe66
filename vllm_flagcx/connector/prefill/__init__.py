"""Prefill's half of a transfer: the side channel that serves pulls (``server``), where it
listens and who may talk to it (``gate``: its sockets, the kernel's record of a peer, its MAC
and role), what it keeps of decode's pulls (``pulls``), and the transfers it holds until
decode has them with the writes into them (``sends``). Never imports ``connector.decode``."""
