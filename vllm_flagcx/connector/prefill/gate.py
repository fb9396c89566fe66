"""Who may talk to prefill's side channel, decided before any payload is read.

A message passes these checks in order: the ZMQ REQ envelope (anything else has nobody to
answer and is dropped), the kernel's record of a Unix-socket peer (``peer_credentials``;
without a secret only this uid, which the socket directory's mode already enforces), the
message's MAC (``wire.auth``: the full key, or the router's one-way key, which makes the
sender a ``router``), and, under CURVE, the credential's role (``wire.curve``); the
lesser role wins. A refusal is answered bare (the sender may lack the key) and counted;
nothing here raises into the server thread. The server (``prefill.server``)
handles what gets through, and checks a same-host pull's target with the peer found here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from vllm_flagcx.connector.common.counters import Counters
from vllm_flagcx.connector.prefill.peer_credentials import PeerCred, from_peer_address
from vllm_flagcx.wire import auth, curve
from vllm_flagcx.wire import handshake as hs
from vllm_flagcx.wire.metrics import Stat

logger = logging.getLogger("vllm_flagcx")

_WARN_AT = (1, 10, 100, 1000)  # a refusal kind is logged at these counts, not every time


@dataclass(frozen=True)
class Admitted:
    """A message that may be handled: its envelope identity, the opened payload, the
    connecting process of a Unix-socket peer (None over TCP) and the sender's role."""

    ident: bytes
    data: bytes
    peer: PeerCred | None
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
        self._router_key = auth.router_mac(key) if key is not None else None
        self._counters = counters
        self._uid = os.getuid()

    def admit(self, parts: list[Any], curve_on: bool, local: bool
              ) -> Admitted | Refused | None:
        """The verdict on one received multipart message (ZMQ frames, not copied);
        ``local``: it came over the Unix socket."""
        frames = [p.bytes for p in parts]
        if len(frames) != 3 or frames[1] != b"":
            self._counters.add(Stat.MALFORMED_MESSAGES)
            return None  # not a REQ envelope: nobody to answer
        ident, _, frame = frames
        peer = from_peer_address(_property(parts[-1], "Peer-Address")) if local else None
        refusal = self._peer_refusal(local, peer)
        if refusal is not None:  # answered bare, before the payload is looked at
            self._refused(Stat.REFUSED_PEERS, "messages from local peers", refusal)
            return Refused(ident, hs.HandshakeRefused(refusal))
        role = curve.role_of(parts[-1]) if curve_on else "decode"
        try:
            data = auth.unseal(self._key, frame)
        except auth.AuthError as exc:  # answered bare: the sender may lack the key
            routed = self._router_payload(frame)
            if routed is None:
                self._refused(Stat.UNAUTHENTICATED_MESSAGES, "unauthenticated messages",
                              str(exc))
                return Refused(ident, hs.HandshakeRefused(str(exc)))
            data, role = routed, "router"
        return Admitted(ident, data, peer, role)

    def _peer_refusal(self, local: bool, peer: PeerCred | None) -> str | None:
        if not local:
            return None
        if peer is None:
            return "the kernel gave no credentials for this Unix-socket connection"
        if self._key is None and peer.uid != self._uid:
            return (f"the connecting process runs as uid {peer.uid}: without a secret this "
                    f"side channel serves only uid {self._uid} on this host (set the same "
                    "secret on prefill, decode and the router to serve other users)")
        return None

    def _router_payload(self, frame: bytes) -> bytes | None:
        if self._router_key is None:
            return None
        try:
            return auth.unseal(self._router_key, frame)
        except auth.AuthError:
            return None

    def _refused(self, stat: Stat, what: str, why: str) -> None:
        refused = self._counters.add(stat)
        if refused in _WARN_AT:
            logger.warning("FlagCX side channel: refused %d %s so far: %s", refused, what,
                           why)

    def seal_key(self, role: str) -> bytes | None:
        """The key an answer to ``role`` is sealed with (the router checks its own)."""
        return self._router_key if role == "router" else self._key


def _property(frame: Any, name: str) -> str | None:
    try:
        return str(frame.get(name))
    except Exception:  # libzmq without the property
        return None
