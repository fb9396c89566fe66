"""Where prefill's side channel listens, and who may talk to it, decided before any payload
is read.

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

Where it listens, and how an answer finds its way back: one ROUTER socket per endpoint: the
rank's Unix socket (``wire.endpoints``), always, and TCP ``side_channel_bind:port`` only
with a secret. Two sockets, not two endpoints of one, so the server knows for sure which
messages came over the Unix socket (only their ``Peer-Address`` carries the kernel's
record; a TCP peer's address is never parsed as one). With a secret every socket is CURVE,
its keys admitted by one ZAP handler.

Every ident the server hands around (to parked pulls, writer threads, ``Sends``) starts
with the socket it came in on and the sender's role, so a reply posted later goes out on
the right socket, sealed with the key that sender checks (``Gate.seal_key``).
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import zmq

from vllm_flagcx.connector.common.counters import Counters
from vllm_flagcx.connector.common.host_cpus import unpinned
from vllm_flagcx.connector.common.worker_settings import WorkerSettings
from vllm_flagcx.wire import auth, curve, endpoints
from vllm_flagcx.wire import handshake as hs
from vllm_flagcx.wire.metrics import Stat

logger = logging.getLogger("vllm_flagcx")

MAX_FRAME_BYTES = 16 << 20  # a larger side-channel frame drops its connection
# A connection that has not finished the ZMTP (and, with a secret, CURVE) handshake within
# this time is closed: a stranger's idle connections cost a file descriptor each, briefly.
HANDSHAKE_SECONDS = 5.0
UNIX, TCP = b"U", b"T"
ROLE_TAGS = {"decode": b"d", "router": b"r"}


def bind_error(host: str, port: int, rank: int, exc: Exception) -> RuntimeError:
    """What to do when the side channel cannot listen, naming the setting."""
    if getattr(exc, "errno", None) == errno.EADDRINUSE:
        return RuntimeError(
            f"kv_connector_extra_config.side_channel_port: port {port} (base + TP rank "
            f"{rank}) on {host} is in use; give each prefill instance its own "
            "side_channel_port, its ranks use base .. base + TP size - 1")
    return RuntimeError(
        f"kv_connector_extra_config.side_channel_bind / side_channel_host={host!r}: the side "
        f"channel cannot listen there ({exc}); use an IP address of this machine's "
        "interfaces (or 0.0.0.0 with a secret), not a host name")


def free_socket_path(port: int, tp_rank: int) -> str:
    """This rank's Unix socket path in the private socket directory (made if missing);
    RuntimeError naming the setting when a live process already serves it."""
    path = endpoints.socket_path(port, endpoints.ensure_private_dir())
    if endpoints.in_use(path):
        raise RuntimeError(
            f"kv_connector_extra_config.side_channel_port: {path} (port {port}, base + TP "
            f"rank {tp_rank}) is served by another process; give each prefill instance its "
            "own side_channel_port")
    return path


def check_free(bind_host: str, port: int, tp_rank: int, secret: bool) -> None:
    """Refuse, naming the setting, a side channel this rank could not open later: checked
    when vLLM builds the worker's connector, before the model loads (a port found taken
    at ``register_kv_caches`` cost minutes of engine start first)."""
    import socket

    free_socket_path(port, tp_rank)
    if not secret:
        return  # no TCP port without a secret
    try:
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((bind_host, port))
    except OSError as exc:
        raise bind_error(bind_host, port, tp_rank, exc) from None


def route(tag: bytes, role: str, ident: bytes) -> bytes:
    """The ident the server hands around for a sender's ZMQ ``ident``."""
    return tag + ROLE_TAGS.get(role, b"r") + ident


def routed_role(ident: bytes) -> str:
    """The sender's role a ``route`` carries (what its answer is sealed for)."""
    return "decode" if ident[1:2] == ROLE_TAGS["decode"] else "router"


class Listeners:
    """The side channel's ZMQ context, sockets and ZAP handler for one rank."""

    def __init__(self, settings: WorkerSettings, port: int) -> None:
        self._settings = settings
        self.port = port
        self.context: zmq.Context | None = None  # zmq is imported lazily: imports stay cheap
        self.socks: dict[bytes, zmq.Socket] = {}  # UNIX / TCP -> the ROUTER socket
        self.zap: curve.ZapHandler | None = None

    @property
    def curve_on(self) -> bool:
        return self.zap is not None

    def open(self) -> None:
        """Bind; RuntimeError (or ``endpoints.SocketDirError``) naming the setting when an
        endpoint cannot be bound. Without a secret there is no TCP port: another user can
        neither connect nor make prefill buffer a byte (the socket's directory is 0700)."""
        import zmq

        settings = self._settings
        auth.require_secret_off_loopback(settings.bind_host, settings.key)
        path = free_socket_path(self.port, settings.tp_rank)
        with unpinned():  # the context's I/O thread starts with the first socket
            self.context = zmq.Context()
        if settings.key is not None and curve.available():
            # strangers are refused in the connection's handshake: no byte is buffered
            self.zap = curve.ZapHandler(self.context, settings.key)
        try:
            self.socks[UNIX] = self._listen(f"ipc://{path}")
            if settings.key is not None:
                self.socks[TCP] = self._listen(f"tcp://{settings.bind_host}:{self.port}")
        except zmq.ZMQError as exc:
            self.close_sockets()  # else the context's term() waits on them forever
            raise bind_error(settings.bind_host, self.port, settings.tp_rank,
                             exc) from None

    def _listen(self, address: str) -> zmq.Socket:
        import zmq

        assert self.context is not None, "open() makes the context first"
        with unpinned():
            sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_SECONDS * 1000))
        if self.zap is not None and self._settings.key is not None:
            curve.configure_server(sock, self._settings.key)
        try:
            sock.bind(address)
        except zmq.ZMQError:
            sock.close()
            raise
        return sock

    def register(self, poller: zmq.Poller) -> None:
        import zmq

        for sock in self.socks.values():
            poller.register(sock, zmq.POLLIN)
        if self.zap is not None:
            poller.register(self.zap.sock, zmq.POLLIN)

    def send(self, ident: bytes, frame: bytes) -> None:
        """``frame`` to the sender of ``ident`` (a ``route``), on the socket it used."""
        self.socks[ident[:1]].send_multipart([ident[2:], b"", frame])

    def close_sockets(self) -> None:
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()
        if self.zap is not None:  # kept: its refusal count outlives the sockets
            self.zap.close()

    def term(self) -> None:
        if self.context is not None:
            self.context.term()
            self.context = None


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
