"""Where prefill's side channel listens, and how an answer finds its way back.

One ROUTER socket per endpoint: the rank's Unix socket (``wire.endpoints``), always, and
TCP ``side_channel_bind:port`` only with a secret. Two sockets, not two endpoints of one,
so the server knows for sure which messages came over the Unix socket (only their
``Peer-Address`` carries the kernel's record; a TCP peer's address is never parsed as
one). With a secret every socket is CURVE, its keys admitted by one ZAP handler.

Every ident the server hands around (to parked pulls, writer threads, ``Sends``) starts
with the socket it came in on and the sender's role, so a reply posted later goes out on
the right socket, sealed with the key that sender checks (``Gate.seal_key``).
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import zmq

from vllm_flagcx.connector.common.host_cpus import unpinned
from vllm_flagcx.connector.common.worker_settings import WorkerSettings
from vllm_flagcx.wire import auth, curve, endpoints

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
