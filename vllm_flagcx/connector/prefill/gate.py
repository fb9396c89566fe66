"""Who may talk to prefill's side channel, decided before any payload is read.

A message passes these checks in order: the ZMQ REQ envelope (anything else has nobody to
answer and is dropped), the kernel's record of a Unix-socket peer (below;
without a secret only this uid, which the socket directory's mode already enforces), the
message's MAC (``wire.auth``: the full key, or the router's one-way key, which makes the
sender a ``router``), and, under CURVE, the credential's role (``wire.curve``); the
lesser role wins. A refusal is answered bare (the sender may lack the key) and counted;
nothing here raises into the server thread. The server (``prefill.server``)
handles what gets through, and checks a same-host pull's target with the peer found here.

Who is on the other end of a same-host connection, as the kernel says (``PeerCred``). A
same-host pull makes prefill write (``process_vm_writev``, CUDA IPC) into the process
its sheet names, so that process must be the one that connected, as it is now. The
kernel records the connecting process of a Unix socket at ``connect`` (``SO_PEERCRED``:
pid, uid, gid), and libzmq attaches that record to every message of the connection (its
``Peer-Address`` property, ``...:uid:gid:pid``): the identity belongs to the connection
for its whole life, not to an fd number looked up after the fact (libzmq delivers a
closed connection's messages while a new connection may hold the same fd number).

Checked per pull, at admission and again right before the write (``target_refusal``):

* it came over the Unix socket (a TCP peer has no kernel record: refused, whatever its
  address says, since a same-host process may reach this host's routable address);
* the pid it names is the pid that connected (an fd handed to a child does not let the
  child name itself, or anyone else);
* that process still runs as the uid and gid it connected as, real, effective, saved
  and filesystem ids alike (``/proc/<pid>/status``): an exec of a set-user-ID program
  after connecting, or a pid recycled by another user's process, is refused.

What it does not catch: a pid recycled by a process of the same user and group (which
could be written into anyway by that user), or an exec that gains file capabilities.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

from vllm_flagcx.connector.common.counters import Counters
from vllm_flagcx.wire import auth, curve
from vllm_flagcx.wire import handshake as hs
from vllm_flagcx.wire.metrics import Stat

logger = logging.getLogger("vllm_flagcx")

PROC = "/proc"
_WARN_AT = (1, 10, 100, 1000)  # a refusal kind is logged at these counts, not every time



class PeerCred(NamedTuple):
    """The connecting process of a Unix-socket connection, as the kernel recorded it."""

    uid: int
    gid: int
    pid: int


def from_peer_address(value: str | None) -> PeerCred | None:
    """The credentials in libzmq's ``Peer-Address`` of an ``ipc://`` connection
    (``<host>:<uid>:<gid>:<pid>``); None when it holds none. Read only for messages of
    the Unix-socket endpoint: a TCP peer's address is never parsed as one."""
    if not value:
        return None
    parts = value.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid, pid = (int(p) for p in parts[1:])
    except ValueError:
        return None
    return PeerCred(uid, gid, pid) if pid > 0 and uid >= 0 and gid >= 0 else None


def process_ids(pid: int, proc: str = PROC) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(uids, gids) of process ``pid``: real, effective, saved, filesystem; None when no
    such process is visible."""
    try:
        with open(f"{proc}/{pid}/status", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    found: dict[str, tuple[int, ...]] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("Uid", "Gid"):
            try:
                found[name] = tuple(int(v) for v in rest.split())
            except ValueError:
                return None
    if len(found.get("Uid", ())) != 4 or len(found.get("Gid", ())) != 4:
        return None
    return found["Uid"], found["Gid"]


def target_refusal(peer: PeerCred | None, declared_pid: int, proc: str = PROC) -> str | None:
    """Why a same-host pull from ``peer`` (None: not a Unix-socket connection) may not
    make prefill write into process ``declared_pid``, or None (see the module docstring)."""
    if peer is None:
        return ("a same-host transport's pull must come over the side channel's Unix "
                "socket (the kernel vouches for its process); this one came over TCP. Run "
                "decode with the same FLAGCX_SIDE_CHANNEL_SOCKET_DIR as prefill, or set "
                "kv_connector_extra_config.transport='flagcx'")
    if declared_pid != peer.pid:
        return (f"the pull's transport names pid {declared_pid}, but the connection was "
                f"opened by pid {peer.pid}: a pull may only name its own process")
    ids = process_ids(declared_pid, proc)
    if ids is None:
        return f"process {declared_pid} is gone"
    uids, gids = ids
    if set(uids) != {peer.uid} or set(gids) != {peer.gid}:
        return (f"process {declared_pid} now runs as uids {uids} / gids {gids}, not as "
                f"uid {peer.uid} / gid {peer.gid} it connected as (an exec of a "
                "set-user-ID program?): not written into")
    return None



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
