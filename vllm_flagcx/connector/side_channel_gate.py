"""Who may talk to prefill's side channel, decided before any payload is read.

A message passes four checks in order: the ZMQ REQ envelope (anything else has nobody to
answer and is dropped), the kernel's word on a local peer (``peer_credentials.PeerCheck``:
this uid without a secret; a pull may name only its own process), the message's MAC
(``wire.auth``), and, under CURVE, the credential's role (``wire.curve``). A refusal is
answered bare (the sender may lack the key) and counted; nothing here raises into the
server thread. The server (``side_channel_server``) handles what gets through.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm_flagcx.connector.counters import Counters
from vllm_flagcx.connector.peer_credentials import Owner, PeerCheck
from vllm_flagcx.wire import auth, curve
from vllm_flagcx.wire import handshake as hs
from vllm_flagcx.wire.metrics import Stat

logger = logging.getLogger("vllm_flagcx")

_WARN_AT = (1, 10, 100, 1000)  # a refusal kind is logged at these counts, not every time


@dataclass(frozen=True)
class Admitted:
    """A message that may be handled: its envelope identity, the opened payload, the
    owner of the peer's socket (a local peer the kernel lists; else None) and the
    sender's role."""

    ident: bytes
    data: bytes
    peer: Owner | None
    role: str


@dataclass(frozen=True)
class Refused:
    """A message answered bare with ``reply`` and not handled."""

    ident: bytes
    reply: hs.Message


class Gate:
    """The side channel's admission checks for one server (see the module docstring)."""

    def __init__(self, key: bytes | None, counters: Counters) -> None:
        self._key = key
        self._counters = counters
        self._peers = PeerCheck(authenticated=key is not None)

    def admit(self, parts: list[Any], curve_on: bool) -> Admitted | Refused | None:
        """The verdict on one received multipart message (ZMQ frames, not copied)."""
        import zmq

        frames = [p.bytes for p in parts]
        if len(frames) != 3 or frames[1] != b"":
            self._counters.add(Stat.MALFORMED_MESSAGES)
            return None  # not a REQ envelope: nobody to answer
        ident, _, frame = frames
        try:
            fd: int | None = int(parts[-1].get(zmq.SRCFD))
        except (zmq.ZMQError, TypeError, ValueError):
            fd = None
        refusal, peer = self._peers.inspect(fd)
        if refusal is not None:  # answered bare, before the payload is looked at
            refused = self._counters.add(Stat.REFUSED_PEERS)
            if refused in _WARN_AT:
                logger.warning("FlagCX side channel: refused %d message(s) from local peers "
                               "so far: %s", refused, refusal)
            return Refused(ident, hs.HandshakeRefused(refusal))
        try:
            data = auth.unseal(self._key, frame)
        except auth.AuthError as exc:  # answered bare: the sender may lack the key
            refused = self._counters.add(Stat.UNAUTHENTICATED_MESSAGES)
            if refused in _WARN_AT:
                logger.warning("FlagCX side channel: refused %d unauthenticated message(s) "
                               "so far: %s", refused, exc)
            return Refused(ident, hs.HandshakeRefused(str(exc)))
        role = curve.role_of(parts[-1]) if curve_on else "decode"
        return Admitted(ident, data, peer, role)

    def pull_refusal(self, peer: Owner | None, pid: int) -> str | None:
        """Why a pull naming process ``pid`` as the write's target must be refused (it
        is not the process on the other end of the connection), or None. ``peer``: what
        ``admit`` found for the same message (the kernel is not asked again)."""
        refused = self._peers.pid_refusal(peer, pid)
        if refused is not None:
            self._counters.add(Stat.REFUSED_PEERS)
        return refused
