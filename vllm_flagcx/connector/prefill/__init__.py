"""Prefill's half of a transfer: the side channel that serves pulls (``server``), where it
listens and who may talk to it (``gate``: its sockets, the kernel's record of a peer, its MAC
and role), the writes (``writes``), and the transfers it holds until decode has them
(``sends``, ``pulls``). Never imports ``connector.decode``."""
