"""The side channel's client half: one request, one answer, bounded by a timeout.

Decode's workers use it to handshake, pull and release; the router uses
``release_transfer`` to free what prefill holds for a client that went away after prefill
finished but before decode started (else the blocks wait for the lease to expire).

**Lease renewal** (``HeartbeatSender``), for transfers decode will pull but has not yet: a
decode request can wait in decode's queue (no free blocks) long after prefill finished.
Prefill holds its blocks only for a lease; this thread, in the decode scheduler process,
renews the lease of every awaited transfer every ``interval`` seconds, on every prefill
rank, until the request is allocated (then the pull itself takes over) or ends. Which
transfers are awaited is not kept here: ``targets`` asks their owner (decode's
``connector.decode.loads.Loads``) each round. ``wake`` beats the ones not beaten yet at
once: that first word turns prefill's short first lease into the full one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from vllm_flagcx.wire import auth, curve, endpoints
from vllm_flagcx.wire import handshake as hs
from vllm_flagcx.wire.params import RemotePrefill, TransferId

logger = logging.getLogger("vllm_flagcx")

HANDSHAKE_EVENTS = (1 << 11) | (1 << 13) | (1 << 14)  # zmq.EVENT_HANDSHAKE_FAILED_*


class PeerGoneError(ConnectionError):
    """The peer's side-channel port refuses connections: no process listens there.

    Prefill's side channel lives in the worker process that also issues the writes, so a
    refused port means that process is gone and no write of it can still be in flight;
    decode need not wait out the timeout (40 s for a pull, the 30 s lease for a release)
    before it reports the blocks for recompute. A peer that does not answer at all (a host
    down, a dropped packet) is not "gone": only a refusal is proof.
    """


listening = endpoints.listening


def ask(context: Any, host: str, port: int, message: hs.Message, timeout: float,
        probe_every: float | None = None, key: auth.Key = None,
        role: str = "decode") -> hs.Message:
    """Send ``message`` to ``host:port`` over a new connection and return the answer;
    TimeoutError after ``timeout`` seconds without one. A caller that talks to the same
    peers again should hold a ``Channels`` instead (one connection per peer, kept).

    ``probe_every``: while waiting, check this often whether the port still accepts
    connections, and raise PeerGoneError as soon as it refuses (ZMQ itself reconnects to
    a dead peer silently, forever). ``key``: the side-channel secret's MAC key
    (``auth.load_key``); an answer that fails authentication raises ``auth.AuthError``.
    With a key the connection is CURVE-encrypted as ``role`` (``curve``; the router holds
    an ``auth.RouterCredential``, not the key), and a
    handshake the peer refuses raises ``auth.AuthError`` saying which side's secret is
    missing or differs, instead of waiting out the timeout.
    """
    key = _key_for(key, role)
    conn = _Connection.open(context, host, port, timeout, key, role)
    try:
        return conn.exchange(message, timeout, probe_every, key)
    finally:
        conn.close()


def _key_for(key: auth.Key, role: str) -> auth.Key:
    """A router given the full key still speaks with the router's credential: prefill
    answers a router under that one."""
    if role == "router" and isinstance(key, bytes):
        return curve.router_credential(key)
    return key


class _Connection:
    """One REQ socket to one peer and its handshake monitor. Usable again only after an
    exchange that got its answer (a REQ socket that missed one is stuck)."""

    def __init__(self, sock: Any, monitor: Any, host: str, port: int) -> None:
        self.sock, self.monitor, self.host, self.port = sock, monitor, host, port

    @classmethod
    def open(cls, context: Any, host: str, port: int, timeout: float,
             key: auth.Key, role: str) -> _Connection:
        """A connection to the side channel at ``host:port``: its Unix socket where it is
        on this host and this user's directory holds one (``endpoints``), else TCP."""
        import zmq

        sock = context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        if key is not None and curve.available():
            curve.configure_client(sock, key, role)
        conn = cls(sock, sock.get_monitor_socket(HANDSHAKE_EVENTS), host, port)
        try:
            sock.connect(endpoints.address(host, port))
        except zmq.ZMQError as exc:  # a malformed host: an OSError every caller handles
            conn.close()
            raise ConnectionError(f"cannot connect to {host!r}:{port}: {exc}") from None
        return conn

    def exchange(self, message: hs.Message, timeout: float, probe_every: float | None,
                 key: auth.Key) -> hs.Message:
        import zmq

        host, port, sock = self.host, self.port, self.sock
        deadline = time.monotonic() + timeout

        def late() -> str:  # built only when raised: the hint probes the socket
            return f"no answer from {host}:{port} within {timeout:.1f} s" \
                f"{endpoints.hint(host, port)}"

        try:
            sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
            sock.send(auth.seal(key, hs.encode(message)))
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(late())
                wait = left if probe_every is None else min(left, probe_every)
                ready = dict(_poller(sock, self.monitor).poll(max(1, int(wait * 1000))))
                if ready.get(sock):
                    return _open_answer(key, sock.recv())
                if ready.get(self.monitor):
                    _raise_on_handshake_failure(self.monitor, key is not None, host, port)
                elif probe_every is not None and listening(host, port) is False:
                    raise PeerGoneError(f"{host}:{port} refuses connections: the prefill "
                                        "worker that serves it is gone"
                                        f"{endpoints.hint(host, port)}")
        except zmq.error.Again as exc:  # the send itself timed out
            raise TimeoutError(late()) from exc
        except zmq.error.ContextTerminated as exc:  # this worker shuts down under the wait
            raise ConnectionAbortedError(f"asking {host}:{port}: the side channel was "
                                         "closed (shutdown)") from exc

    def close(self) -> None:
        import zmq

        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()


class Channels:
    """Side-channel connections kept per peer (``host, port``, secret and role), so a
    pull, heartbeat or release pays the TCP connect and, with a secret, the CURVE
    handshake once per peer instead of once per message (issue 27: about 6 ms a message
    with CURVE on).

    ``ask`` takes an idle connection to the peer or opens one; after an answer the
    connection goes back (at most ``max_idle`` idle per peer), after any failure it is
    closed, so a stuck or half-dead connection is never reused, and the next message
    reconnects. Thread-safe: a connection is used by one thread at a time. ``close``
    closes the idle ones and makes later returns close theirs (call it before the ZMQ
    context's ``term``).
    """

    def __init__(self, context: Any, max_idle: int = 8) -> None:
        self._context = context
        self._max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int, auth.Key, str], list[_Connection]] = {}
        self._closed = False
        self.opened = 0  # connections opened so far (tests, benchmarks)

    def ask(self, host: str, port: int, message: hs.Message, timeout: float,
            probe_every: float | None = None, key: auth.Key = None,
            role: str = "decode") -> hs.Message:
        """``client.ask`` over a kept connection (same arguments and errors)."""
        key = _key_for(key, role)
        peer = (host, port, key, role)
        with self._lock:
            if self._closed:
                raise ConnectionAbortedError(f"asking {host}:{port}: the side channel was "
                                             "closed (shutdown)")
            idle = self._idle.get(peer)
            conn = idle.pop() if idle else None
            if conn is None:
                self.opened += 1
        if conn is None:
            conn = _Connection.open(self._context, host, port, timeout, key, role)
        answered = False
        try:
            reply = conn.exchange(message, timeout, probe_every, key)
            answered = True
            return reply
        finally:
            self._give_back(peer, conn, answered)

    def _give_back(self, peer: tuple[str, int, auth.Key, str], conn: _Connection,
                   reusable: bool) -> None:
        with self._lock:
            idle = self._idle.setdefault(peer, [])
            if reusable and not self._closed and len(idle) < self._max_idle:
                idle.append(conn)
                return
        conn.close()

    def forget(self, host: str, port: int) -> None:
        """Close the idle connections to ``host:port`` (its process was replaced)."""
        with self._lock:
            gone = [c for peer, conns in self._idle.items() if peer[:2] == (host, port)
                    for c in conns]
            self._idle = {p: c for p, c in self._idle.items() if p[:2] != (host, port)}
        for conn in gone:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()


def _poller(sock: Any, monitor: Any) -> Any:
    import zmq

    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    return poller


def _raise_on_handshake_failure(monitor: Any, with_key: bool, host: str, port: int) -> None:
    from zmq.utils.monitor import recv_monitor_message

    event = recv_monitor_message(monitor)
    why = curve.handshake_failure(int(event["event"]), int(event["value"]), with_key)
    if why is not None:
        raise auth.AuthError(f"{host}:{port}: {why}")


def _open_answer(key: auth.Key, frame: bytes) -> hs.Message:
    """The answer if it authenticates. A peer that refused us for want of the right
    secret answers with a bare refusal: its reason is added to the error, never trusted."""
    try:
        return hs.decode(auth.unseal(key, frame))
    except auth.AuthError as exc:
        said = ""
        if not frame.startswith(auth.MAGIC):
            with contextlib.suppress(hs.HandshakeError):
                answer = hs.decode(frame)
                if isinstance(answer, hs.HandshakeRefused):
                    said = f" (the peer says: {answer.reason[:300]})"
        raise auth.AuthError(f"{exc}{said}") from None


def release_transfer(host: str, port: int, tp_size: int, transfer_id: str,
                     timeout: float = 2.0, key: auth.Key = None,
                     role: str = "router") -> list[str]:
    """Send ``Release(transfer_id)`` to prefill ranks ``port .. port+tp_size-1``; returns
    the errors (empty when every rank acknowledged)."""
    import zmq

    errors = []
    for rank in range(tp_size):
        try:
            reply = ask(zmq.Context.instance(), host, port + rank,
                        hs.Release(TransferId(transfer_id)), timeout, key=key, role=role)
            if not isinstance(reply, hs.Ack):
                errors.append(f"{host}:{port + rank}: answered {type(reply).__name__}")
        except (TimeoutError, OSError, zmq.ZMQError, hs.HandshakeError) as exc:
            errors.append(f"{host}:{port + rank}: {exc}")
    return errors


class HeartbeatSender:
    """Decode's lease renewals (the module docstring)."""

    def __init__(self, interval: float, targets: Callable[[], Iterable[RemotePrefill]],
                 timeout: float = 1.0, key: bytes | None = None) -> None:
        self.interval = interval
        self.key = key  # the side-channel secret's MAC key (``auth.load_key``)
        self.timeout = timeout
        self._awaited = targets  # thread-safe: called from the heartbeat thread
        self._beaten: set[TransferId] = set()  # of the last round (heartbeat thread)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._channels: Channels | None = None  # kept connections, made at first use
        self.sent = 0

    def wake(self) -> None:
        """A transfer became awaited: beat the new ones now (starts the thread once)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="flagcx-heartbeat")
                self._thread.start()
        self._wake.set()

    def _targets(self, fresh_only: bool = False
                 ) -> dict[tuple[str, int, int], list[TransferId]]:
        awaited = list(self._awaited())
        ids = {remote.transfer_id for remote in awaited}
        if fresh_only:
            awaited = [r for r in awaited if r.transfer_id not in self._beaten]
            self._beaten |= ids
        else:
            self._beaten = ids
        out: dict[tuple[str, int, int], list[TransferId]] = defaultdict(list)
        for remote in awaited:
            out[(remote.remote_host, remote.remote_port, remote.remote_tp_size)].append(
                remote.transfer_id)
        return out

    def beat_once(self, fresh_only: bool = False) -> None:
        """One round of heartbeats (the thread calls this every ``interval``, and for the
        new ones alone when woken)."""
        import zmq

        with self._lock:  # one kept connection per prefill rank
            if self._channels is None:
                self._channels = Channels(zmq.Context.instance())
            channels = self._channels
        for (host, port, tp), tids in self._targets(fresh_only).items():
            for rank in range(tp):
                try:
                    channels.ask(host, port + rank, hs.Heartbeat(tuple(tids)),
                                 self.timeout, key=self.key)
                    self.sent += 1
                except (TimeoutError, OSError, zmq.ZMQError, hs.HandshakeError) as exc:
                    logger.debug("heartbeat to %s:%d failed: %s", host, port + rank, exc)

    def _run(self) -> None:
        next_round = time.monotonic() + self.interval
        while not self._stop.is_set():
            woken = self._wake.wait(max(0.0, next_round - time.monotonic()))
            if self._stop.is_set():
                return
            if woken:
                self._wake.clear()
            if time.monotonic() >= next_round:
                self.beat_once()
                next_round = time.monotonic() + self.interval
            elif woken:
                self.beat_once(fresh_only=True)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.timeout + self.interval)
        if self._channels is not None:
            self._channels.close()
