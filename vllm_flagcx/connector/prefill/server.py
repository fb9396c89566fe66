"""Prefill's side-channel server: handshakes, pulls, releases, heartbeats, and the writes.

One thread owns the ZMQ sockets (``_serve``; where they listen: ``prefill.gate``);
writes run on writer threads (``_write_job``) and their replies come back through an
outbox. The transfers' lifecycle and its safety
invariant (a Release is acknowledged only once no write into its blocks is in flight) are
``sends.Sends``: this server claims a write before it runs and finishes it exactly once
after (``_write_job``), and posts the Releases that waited only then. Every pull is checked
before bytes move: its fields (``pull_problem``), the receiver's regions pinned per
incarnation (``pulls.ReceiverCache``), each descriptor against registered memory
(``bounds.check_within``), the transfer's first puller (``Sends.claim``), and for the
same-host transport the process it names (``gate.target_refusal``: the one that connected,
as it ran then; asked again right before the write).

Who may talk at all (envelope, local peer, MAC, CURVE role) is decided first, by
``prefill.gate.Gate``. It owns its sockets, thread, wake pipe, outbox, parked pulls
and writer pool; the transfers (``Sends``) and the counters are shared with the worker
that built it, and what was registered comes as one frozen ``Registration``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm_flagcx.connector.common.counters import Counters
from vllm_flagcx.connector.common.host_cpus import unpin_this_thread
from vllm_flagcx.connector.common.registration import Registration
from vllm_flagcx.connector.common.task_threads import InFlight
from vllm_flagcx.connector.common.worker_settings import WorkerSettings
from vllm_flagcx.connector.prefill.gate import (
    UNIX,
    Gate,
    Listeners,
    PeerCred,
    Refused,
    route,
    routed_role,
    target_refusal,
)
from vllm_flagcx.connector.prefill.pulls import ParkedPull, ParkedPulls, pull_problem
from vllm_flagcx.connector.prefill.sends import LEASE_EXPIRED, Claim, Send, Sends, SideChannelWrites
from vllm_flagcx.transport.base import Transport
from vllm_flagcx.wire import auth, curve
from vllm_flagcx.wire import handshake as hs
from vllm_flagcx.wire.metrics import Stat
from vllm_flagcx.wire.params import TransferId

logger = logging.getLogger("vllm_flagcx")

class Pending(enum.Enum):
    """A claimed pull with no answer yet: its write runs (``WRITING``) or it must keep
    waiting for its arm or a writer (``WAIT``)."""

    WRITING = "writing"
    WAIT = "wait"


# How often the server thread looks at parked pulls when nothing else wakes it (their
# deadlines); an arm, a new message or a posted answer wakes it at once.
POLL_SECONDS = 0.02


def _superseded(pull: hs.PullRequest | None) -> hs.PullReply:
    return hs.PullReply(pull.transfer_id if pull else TransferId(""), False,
                        "superseded by an identical pull (same transfer, receiver and rank)")


class SideChannelServer:
    """Prefill's side channel for one TP rank (see the module docstring)."""

    def __init__(self, settings: WorkerSettings, transport: Transport,
                 registration: Registration, sends: Sends, counters: Counters,
                 in_flight: InFlight) -> None:
        self._settings = settings
        self._in_flight = in_flight  # claimed writes, queued or running
        self._transport = transport
        self._registration = registration
        self._sends = sends
        self._counters = counters
        self.parked = ParkedPulls()  # pulls that wait for an arm or a writer (tests cap it)
        self._gate = Gate(settings.key, counters)  # who may talk, before any payload
        self._writes = SideChannelWrites(settings, transport, registration, sends,
                                         counters, self._post)
        # Writes run on writer threads, never on the side-channel thread (one slow write
        # stalled every handshake, heartbeat and release behind it); their replies come
        # back through the outbox, and a byte on the wake pipe tells the server thread.
        self._writer: ThreadPoolExecutor | None = None
        self._outbox: deque[tuple[bytes, hs.Message]] = deque()
        self._wake_r, self._wake_w = -1, -1
        self._stop = threading.Event()
        self._draining = False  # shutting down: no new write is claimed
        self._thread: threading.Thread | None = None
        self._listeners = Listeners(settings, self.port)

    @property
    def alive(self) -> bool:
        """The server thread runs (nothing a peer sends may end it)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def curve_refusals(self) -> int:
        """Connections the CURVE handshake refused (an underived key): none reached us."""
        zap = self._listeners.zap
        return zap.refused if zap is not None else 0

    @property
    def port(self) -> int:
        return self._settings.side_channel_port + self._settings.tp_rank

    def start(self) -> None:
        """Listen (``prefill.sockets``: the rank's Unix socket, and TCP
        ``side_channel_port + tp_rank`` with a secret) and serve; RuntimeError naming the
        setting when it cannot."""
        self._listeners.open()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._writer = ThreadPoolExecutor(
            max_workers=max(1, int(self._transport.max_concurrent_writes)),
            thread_name_prefix=f"flagcx-write-{self.port}", initializer=unpin_this_thread)
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"flagcx-side-channel-{self.port}")
        self._thread.start()

    def shutdown(self) -> None:
        """Stop serving, never closing the port before the writes in flight ended: decode
        reads a port that refuses connections as "no write in flight here" and gives the
        blocks back to vLLM, so a write landing after the close overwrote reused blocks
        (3 of 4 live requests' KV changed, 23 s later). New pulls are refused while the
        claimed writes finish (bounded by the lease); the side channel keeps answering
        meanwhile (a Release is acknowledged once its write ended); then it closes."""
        self._draining = True
        self._in_flight.wait_idle(self._settings.lease_seconds)
        if self._in_flight.running:
            logger.error("FlagCX side channel: %d write(s) still in flight after %.0f s; "
                         "closing the port anyway", self._in_flight.running,
                         self._settings.lease_seconds)
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._writer is not None:
            self._writer.shutdown(wait=True, cancel_futures=True)
        self._writes.ahead.shutdown()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = -1
        self._listeners.term()

    def _serve(self) -> None:
        import zmq

        unpin_this_thread()
        listeners = self._listeners
        poller = zmq.Poller()
        listeners.register(poller)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(int(POLL_SECONDS * 1e3)))
                if listeners.zap is not None and events.get(listeners.zap.sock):
                    listeners.zap.handle()
                for tag, sock in listeners.socks.items():
                    if events.get(sock):
                        self._serve_one(tag, sock)
                if events.get(self._wake_r):
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                for ident, reply in self._serve_parked():
                    self._send(ident, reply)
                while self._outbox:
                    self._send(*self._outbox.popleft())
        finally:
            listeners.close_sockets()

    def _send(self, ident: bytes, reply: hs.Message, sealed: bool = True) -> None:
        """Answer on the socket ``ident`` came in on, sealed with its sender's key."""
        key = self._gate.seal_key(routed_role(ident))
        payload = hs.encode(reply)
        self._listeners.send(ident, auth.seal(key, payload) if sealed else payload)

    def _post(self, ident: bytes, reply: hs.Message) -> None:
        """Queue an answer for the server thread (the only one that touches the socket)."""
        self._outbox.append((ident, reply))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"w")

    def armed(self, sends: list[Send]) -> None:
        """The worker's step armed ``sends``: a pull parked for one (decode asked before
        prefill finished: the router's concurrent mode) is claimed and written now, not
        at the server thread's next poll (up to ``POLL_SECONDS`` later). Always a byte,
        even with nothing parked: a pull being parked right now is looked at again. Their
        digests start first (``integrity.DigestsAhead``): a parked pull's write then overlaps its
        digest."""
        for send in sends:
            self._writes.ahead.start(send.task.block_ids, send.digests_ahead)
        self._wake()

    def _serve_one(self, tag: bytes, sock: Any) -> None:
        """One message from the side channel; nothing a peer sends may end the server
        thread (a malformed frame list or any error is answered or dropped, and counted)."""
        verdict = self._gate.admit(sock.recv_multipart(copy=False),
                                   self._listeners.curve_on, local=tag == UNIX)
        if verdict is None:
            return
        if isinstance(verdict, Refused):
            self._send(route(tag, "decode", verdict.ident), verdict.reply, sealed=False)
            return
        ident = route(tag, verdict.role, verdict.ident)
        try:
            reply = self._handle(ident, verdict.data, verdict.peer, verdict.role)
        except Exception as exc:  # a bug or a hostile message: answer, keep serving
            self._counters.add(Stat.MALFORMED_MESSAGES)
            logger.warning("FlagCX side channel: message refused: %s: %s",
                           type(exc).__name__, exc)
            reply = hs.HandshakeRefused(f"refused: {type(exc).__name__}")
        if reply is not None:
            self._send(ident, reply)

    def _handle(self, ident: bytes, data: bytes, peer: PeerCred | None = None,
                role: str = "decode") -> hs.Message | None:
        try:
            message = hs.decode(data)
        except hs.HandshakeError as exc:
            return hs.HandshakeRefused(str(exc))
        if role != "decode" and type(message).__name__ not in curve.ROUTER_MAY:
            self._counters.add(Stat.REFUSED_ROLES)
            return hs.HandshakeRefused(f"the {role or 'unknown'} credential may send "
                                       f"{' and '.join(curve.ROUTER_MAY)} only, not "
                                       f"{type(message).__name__}")
        if isinstance(message, hs.HandshakeRequest):
            self._counters.add(Stat.HANDSHAKES_SERVED)
            if message.protocol_version != hs.PROTOCOL_VERSION:
                return hs.HandshakeRefused(
                    f"protocol_version: local {hs.PROTOCOL_VERSION}, remote "
                    f"{message.protocol_version}")
            return hs.HandshakeReply(self._registration.sheet)
        if isinstance(message, hs.Heartbeat):
            renewed = self._sends.renew(list(message.transfer_ids),
                                       time.monotonic() + self._settings.lease_seconds)
            self._counters.add(Stat.LEASE_RENEWALS, renewed)
            return hs.Ack(",".join(message.transfer_ids)[:256])
        if isinstance(message, hs.Release):  # acknowledged once no write is in flight
            if self._sends.expired(message.transfer_id):
                self._counters.add(Stat.NOTIFICATIONS_AFTER_EXPIRY)
            if not self._sends.release(message.transfer_id, ident):
                return None
            return hs.Ack(message.transfer_id)
        if isinstance(message, hs.PullRequest):
            problem = pull_problem(message, len(self._settings.layout.block_sizes))
            if problem:
                return hs.PullReply(message.transfer_id, False, problem)
            refused = self._target_refusal(message, peer)
            if refused is not None:
                return hs.PullReply(message.transfer_id, False, refused)
            return self._claim_or_park(ident, message, len(data), peer)
        return hs.HandshakeRefused(f"unexpected message {type(message).__name__}")

    def _target_refusal(self, pull: hs.PullRequest, peer: PeerCred | None) -> str | None:
        """Why a same-host pull may not write into the process it names (see
        ``gate.target_refusal``), or None; pulls of other transports name no process."""
        pid = self._transport.peer_pid(pull.sheet.transport_desc)
        refused = target_refusal(peer, pid) if pid is not None else None
        if refused is not None:
            self._counters.add(Stat.REFUSED_PEERS)
        return refused

    def _claim_or_park(self, ident: bytes, pull: hs.PullRequest, size: int,
                       peer: PeerCred | None = None) -> hs.Message | None:
        """Claim first (``parked`` says why): a pull for an armed transfer is written or
        answered now; only one that must wait is parked, within the parking caps."""
        now = time.monotonic()
        # a pull is decode's word that it has the request: the full lease from here on
        self._sends.renew([pull.transfer_id], now + self._settings.lease_seconds)
        answer = self._try_claim(ident, pull, now, peer)
        if answer is Pending.WRITING:
            return None
        if not isinstance(answer, Pending):
            return answer
        armed = self._sends.is_armed(pull.transfer_id)
        refusal, replaced = self.parked.park(ParkedPull(
            ident, pull, now + self._settings.lease_seconds, size, armed, peer))
        if refusal is not None:
            self._counters.add(Stat.PULLS_REFUSED_PARKING_FULL)
            return hs.PullReply(pull.transfer_id, False, refusal)
        if replaced is not None and replaced != ident:
            self._post(replaced, _superseded(pull))
        return None

    def _try_claim(self, ident: bytes, pull: hs.PullRequest, now: float,
                   peer: PeerCred | None) -> hs.Message | Pending:
        """The answer to ``pull`` now, ``WRITING`` (a write was started and answers
        later), or ``WAIT`` when it must keep waiting."""
        if self._draining:
            return hs.PullReply(pull.transfer_id, False, "prefill is shutting down")
        claim, what = self._sends.claim(pull.transfer_id, pull.sheet.engine_id)
        if claim is Claim.WRITE:
            assert self._writer is not None and isinstance(what, Send)
            self._in_flight.begin()
            try:
                self._writer.submit(self._write_then_end, ident, what, pull, now, peer)
            except BaseException:
                self._in_flight.end()
                raise
            return Pending.WRITING
        if claim is Claim.REFUSED:
            return hs.PullReply(pull.transfer_id, False, str(what))
        if claim is Claim.ENDED:
            if what == LEASE_EXPIRED:
                self._counters.add(Stat.NOTIFICATIONS_AFTER_EXPIRY)
            return hs.PullReply(pull.transfer_id, False, f"transfer ended here: {what}")
        return Pending.WAIT

    def _write_then_end(self, ident: bytes, send: Send, pull: hs.PullRequest,
                        claimed_at: float, peer: PeerCred | None) -> None:
        try:
            self._writes.run(ident, send, pull, claimed_at,
                             lambda: self._target_refusal(pull, peer))
        finally:
            self._in_flight.end()

    def _serve_parked(self) -> list[tuple[bytes, hs.Message]]:
        now = time.monotonic()
        out, keep = [], []
        for entry in self.parked.take_all():
            answer = self._try_claim(entry.ident, entry.pull, now, entry.peer)
            if answer is Pending.WAIT and not entry.armed and now > entry.deadline:
                answer = hs.PullReply(entry.pull.transfer_id, False,
                                      "unknown or expired transfer id")
            if answer is Pending.WAIT:
                keep.append(entry)
            elif not isinstance(answer, Pending):
                out.append((entry.ident, answer))
        for ident in self.parked.put_back(keep):
            out.append((ident, _superseded(None)))
        return out
