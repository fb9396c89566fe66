"""Prefill's half of a transfer: the side channel that serves pulls (``server``), who may
talk to it (``gate``: the kernel's record of a peer, its MAC and role), where it listens
(``sockets``), the writes (``writes``), and the transfers it holds until decode has them
(``sends``, ``parked``, ``receivers``). Never imports ``connector.decode``."""
