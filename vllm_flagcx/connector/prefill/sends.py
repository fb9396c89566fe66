"""Prefill's transfers, one lifecycle in one place, and the writes that serve them.

A transfer is **armed** when the scheduler hands over its blocks (``arm``), is **written**
by zero or more pulls (``claim`` then ``finish``, one per receiver rank; writes of
different ranks may overlap), and **ends** exactly once: every receiver rank pulled, decode
released it, or its lease expired with no write in flight. Its request id then goes to
``take_done`` (vLLM frees the blocks), and the transfer id is remembered (bounded) so a late
pull is answered at once instead of waiting a lease for an id that will never come back.

The safety invariant lives here: **a Release is acknowledged only when no write into the
transfer's blocks is in flight** (``release`` defers it; the ``finish`` of the last write
returns the deferred acknowledgements), because decode frees and reuses those blocks as
soon as it has the acknowledgement. A lease never expires under a write either. A write
claimed but still queued behind busy writers when the Release arrives does not start
(``may_start``): it is finished unwritten, so the acknowledgement waits only for writes
already under way.

Thread-safe: the side-channel thread, writer threads and the worker's step call in.

**The writes** (``SideChannelWrites``): one claimed pull planned, checked, written and
answered, with the integrity samples taken before the reply (the blocks may be reused
right after it). The side-channel server (``prefill.server``) claims a pull and hands it
here on a writer thread: the plan, the bounds check, the transport and its connections, the
samples, and the rule that a write which waited too long, or whose transfer decode
released meanwhile, never starts.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_flagcx.connector.common import integrity
from vllm_flagcx.connector.common.counters import Counters
from vllm_flagcx.connector.common.metadata import RequestId, SendTask, TransferId
from vllm_flagcx.connector.common.registration import Registration
from vllm_flagcx.connector.common.worker_settings import WorkerSettings
from vllm_flagcx.connector.prefill.pulls import ReceiverCache
from vllm_flagcx.layout import bounds, plans
from vllm_flagcx.transport.base import Transport
from vllm_flagcx.wire import handshake as hs
from vllm_flagcx.wire.metrics import Stat

logger = logging.getLogger("vllm_flagcx")

MAX_ENDED_REMEMBERED = 4096  # ended transfer ids kept to answer late pulls at once
MAX_WRITES_IN_FLIGHT = 64  # per prefill rank; more pulls stay parked
MAX_RELEASE_WAITERS = 16
MAX_EARLY_RENEWALS = 4096  # heartbeats for transfers not armed yet, applied at arm


@dataclass
class Send:
    """One armed transfer (see the module docstring)."""

    task: SendTask
    expected: set[int] | None = None  # receiver ranks, known at the first pull
    pulled: set[int] = field(default_factory=set)
    writes: int = 0  # writes under way: the lease cannot expire, a Release must wait
    receiver: str | None = None  # engine id of the decode instance that pulls it
    release_waiters: list[bytes] = field(default_factory=list)  # Releases to ack after
    # (receiver rank and TP, paired blocks) -> its digest, started at arm
    digests_ahead: integrity.EarlyDigests = field(default_factory=dict)


LEASE_EXPIRED = "its lease expired"  # why a transfer ended, told to a late pull


class Claim(enum.Enum):
    """What a parked pull may do now."""

    WRITE = "write"  # go: a write slot is taken, ``finish`` must follow exactly once
    WAIT = "wait"  # not armed (yet): stay parked until the pull's own deadline
    BUSY = "busy"  # armed, every writer busy: stay parked
    REFUSED = "refused"  # armed, but pulled by another decode instance
    ENDED = "ended"  # ended here (the reason is returned with it)


class Sends:
    """The armed transfers of one prefill rank and their transitions."""

    def __init__(self, max_writes: int = MAX_WRITES_IN_FLIGHT) -> None:
        self._lock = threading.Lock()
        self._armed: dict[TransferId, Send] = {}  # transfer_id -> armed transfer
        self._ended: OrderedDict[TransferId, str] = OrderedDict()  # transfer_id -> why
        self._done: set[RequestId] = set()  # request ids vLLM may free
        # decode's word can come before the worker's step arms the transfer (prefill
        # answered HTTP when the request finished; the blocks reach the worker one step
        # later): transfer_id -> lease end, applied by ``arm``
        self._early: OrderedDict[TransferId, float] = OrderedDict()
        self._max_writes = max_writes
        self.writes_in_flight = 0

    def __len__(self) -> int:
        return len(self._armed)

    def arm(self, task: SendTask) -> Send | None:
        """Hold ``task``'s blocks for pulls; None (and the request done at once) when its
        transfer id is already armed: the second request must not leak its blocks."""
        with self._lock:
            if task.transfer_id in self._armed:
                self._done.add(task.request_id)
                return None
            early = self._early.pop(task.transfer_id, None)
            if early is not None and task.deadline < early:
                task.deadline = early
            send = self._armed[task.transfer_id] = Send(task)
            return send

    def renew(self, transfer_ids: list[TransferId], until: float) -> int:
        """Heartbeat: push leases to ``until``; how many were pushed. An id not armed (nor
        ended) yet is remembered (bounded) and applied when it is armed."""
        renewed = 0
        with self._lock:
            for tid in transfer_ids:
                send = self._armed.get(tid)
                if send is None:
                    if tid not in self._ended:
                        self._early[tid] = until
                        self._early.move_to_end(tid)
                        while len(self._early) > MAX_EARLY_RENEWALS:
                            self._early.popitem(last=False)
                    continue
                if send.task.deadline < until:
                    send.task.deadline = until
                    renewed += 1
        return renewed

    def release(self, transfer_id: TransferId, ident: bytes) -> bool:
        """Decode released ``transfer_id``: True to acknowledge now; False when a write is in
        flight (``finish`` returns ``ident`` for acknowledgement later)."""
        with self._lock:
            send = self._armed.get(transfer_id)
            if send is not None and send.writes:
                if len(send.release_waiters) < MAX_RELEASE_WAITERS:
                    send.release_waiters.append(ident)
                return False
            if send is not None:
                self._end_locked(transfer_id, "released by decode")
            return True

    def is_armed(self, transfer_id: TransferId) -> bool:
        with self._lock:
            return transfer_id in self._armed

    def may_start(self, send: Send) -> bool:
        """A claimed write is about to start: False when decode released the transfer
        since the claim (the write must not run: decode is about to reuse the blocks)."""
        with self._lock:
            return not send.release_waiters

    def claim(self, transfer_id: TransferId, receiver: str) -> tuple[Claim, Send | str | None]:
        """May a pull by engine ``receiver`` write now? ``(WRITE, send)`` takes a write slot;
        ``(ENDED, why)``; ``(REFUSED, why)``; ``(BUSY, None)``; ``(WAIT, None)``."""
        with self._lock:
            send = self._armed.get(transfer_id)
            if send is None:
                ended = self._ended.get(transfer_id)
                return (Claim.ENDED, ended) if ended is not None else (Claim.WAIT, None)
            if send.receiver not in (None, receiver):
                return Claim.REFUSED, "this transfer is pulled by another decode instance"
            if self.writes_in_flight >= self._max_writes:
                return Claim.BUSY, None
            send.writes += 1
            send.receiver = receiver
            self.writes_in_flight += 1
            return Claim.WRITE, send

    def finish(self, transfer_id: TransferId, send: Send, rank: int, tp_size: int) -> list[bytes]:
        """A claimed write is over (done or failed): the transfer ends once every receiver
        rank pulled, or at once when a Release waited for it; the Releases to acknowledge
        now (only once no write is left)."""
        with self._lock:
            send.writes -= 1
            self.writes_in_flight -= 1
            if send.expected is None:
                send.expected = set(range(tp_size))
            send.pulled.add(rank)
            if send.pulled >= send.expected or (send.release_waiters and send.writes == 0):
                self._end_locked(transfer_id, "released by decode" if send.release_waiters
                                 else "already pulled by every receiver rank")
            if send.writes:
                return []
            waiters, send.release_waiters = send.release_waiters, []
            return waiters

    def expire(self, now: float) -> int:
        """End transfers whose lease passed with no write in flight; how many."""
        with self._lock:
            expired = [tid for tid, s in self._armed.items()
                       if s.task.deadline < now and not s.writes]
            for tid in expired:
                self._end_locked(tid, LEASE_EXPIRED)
        return len(expired)

    def expired(self, transfer_id: TransferId) -> bool:
        """Whether ``transfer_id`` ended here because its lease expired (remembered for
        the last ``MAX_ENDED_REMEMBERED`` transfers)."""
        with self._lock:
            return self._ended.get(transfer_id) == LEASE_EXPIRED

    def take_done(self) -> set[RequestId]:
        """Request ids whose transfer ended since the last call (vLLM frees their blocks)."""
        with self._lock:
            done, self._done = self._done, set()
        return done

    def _end_locked(self, transfer_id: TransferId, why: str) -> None:
        send = self._armed.pop(transfer_id, None)
        if send is None:
            return
        self._done.add(send.task.request_id)
        self._ended[transfer_id] = why
        while len(self._ended) > MAX_ENDED_REMEMBERED:
            self._ended.popitem(last=False)


Post = Callable[[bytes, hs.Message], None]  # queue an answer for the server thread


class SideChannelWrites:
    """Runs claimed writes (on the server's writer threads) and posts their answers."""

    def __init__(self, settings: WorkerSettings, transport: Transport,
                 registration: Registration, sends: Sends, counters: Counters,
                 post: Post) -> None:
        self._settings = settings
        self._transport = transport
        self._registration = registration
        self._sends = sends
        self._counters = counters
        self._post = post
        # (incarnation, rank) -> the receiver as its first pull named it, with its plans
        self._receivers = ReceiverCache(settings.tp_rank, settings.tp_size,
                                        len(settings.layout.block_sizes))
        self._connections: dict[str, object] = {}  # receiver incarnation -> transport handle
        self._connect_lock = threading.Lock()
        self.ahead = integrity.DigestsAhead(settings, registration)

    def run(self, ident: bytes, send: Send, pull: hs.PullRequest, claimed_at: float,
            target_refusal: Callable[[], str | None] = lambda: None) -> None:
        """One claimed write, finished exactly once whatever happens (``Sends.finish``), and
        only then answered: the Releases it held back are acknowledged after it.
        ``target_refusal``: asked again right before the bytes move (the process the pull
        names may have exec'd another program since it was admitted).

        A write that waited behind busy writers does not start once decode released the
        transfer, nor later than ``write_start_timeout`` after its claim: decode may have
        given up on it by then, and a late write would land in blocks vLLM reused."""
        reply = hs.PullReply(pull.transfer_id, False, "write not run")
        limit = self._settings.write_start_timeout
        try:
            waited = time.monotonic() - claimed_at
            if not self._sends.may_start(send):
                reply = hs.PullReply(pull.transfer_id, False, "released by decode before "
                                     "this write started: not written")
            elif waited > limit:
                reply = hs.PullReply(pull.transfer_id, False, (
                    f"this write waited {waited:.1f} s for a writer (more than "
                    f"write_start_timeout={limit:g} s): not written"))
            elif (refused := target_refusal()) is not None:
                reply = hs.PullReply(pull.transfer_id, False, refused)
            else:
                reply = self.write(send, pull, waited)
        except Exception as exc:  # the last guard: the claim is still finished below
            logger.warning("FlagCX write for %s: %s: %s", pull.transfer_id,
                           type(exc).__name__, exc)
            reply = hs.PullReply(pull.transfer_id, False, f"{type(exc).__name__}: {exc}")
        finally:
            if not reply.ok:
                self._counters.add(Stat.SEND_FAILURES)
            waiters = self._sends.finish(pull.transfer_id, send, pull.sheet.tp_rank,
                                         pull.sheet.tp_size)
        self._post(ident, reply)
        for waiter in waiters:
            self._post(waiter, hs.Ack(pull.transfer_id))

    def write(self, send: Send, pull: hs.PullRequest, waited: float = 0.0) -> hs.PullReply:
        """Plan, check and write one pull; its reply (``timings``: queued, write, sample and
        the sample's logical part, seconds on this side)."""
        reg = self._registration
        started = time.monotonic()
        try:
            hs.check_compatible(reg.sheet, pull.sheet,
                                skip_hash=self._settings.skip_compat_hash)
            receiver = self._receivers.get(pull.sheet, reg.regions)
            plan = receiver.table.plan(
                send.task.block_ids, pull.block_ids, reg.kernel_ratios or None,
                list(pull.offsets) or None)
            bounds.check_within(plan, reg.storages, receiver.spans)
            if plan.num_descriptors == 0:  # this rank holds none of the receiver's bytes
                return hs.PullReply(pull.transfer_id, True)
            handle = self._connection(receiver.sheet)
            result = self._transport.write(handle, plan.src, plan.dst, plan.length,
                                           plan.src_span, plan.dst_span)
        except Exception as exc:  # whatever a pull names, the transfer ends and is freed
            self._connections.pop(pull.sheet.incarnation, None)
            return hs.PullReply(pull.transfer_id, False, f"{type(exc).__name__}: {exc}")
        if not result.ok:
            self._connections.pop(pull.sheet.incarnation, None)
            return hs.PullReply(pull.transfer_id, False, result.error)
        written = time.monotonic()
        self._counters.add(Stat.SEND_BYTES, plan.num_bytes)
        self._counters.add(Stat.SEND_DESCRIPTORS, plan.num_descriptors)
        self._counters.add(Stat.SEND_SECONDS, written - started)
        sample, crc = self._byte_sample(plan, pull)
        bytes_read = time.monotonic()
        digests = self._digests(send, pull)
        done = time.monotonic()
        return hs.PullReply(pull.transfer_id, True, "", plan.num_bytes, plan.num_descriptors,
                            sample, crc, digests,
                            (waited, written - started, done - written, done - bytes_read))

    def _byte_sample(self, plan: plans.TransferPlan, pull: hs.PullRequest
                     ) -> tuple[tuple[tuple[int, int], ...], int]:
        """Read before the pull ends: the blocks may be freed (and reused) right after.
        None where the reply carries the full digest (its views exist): that covers every
        byte the sample would, and the sample was a second pass on the pull's path
        (16 device reads here, as many on decode: ~0.8 ms on an H100)."""
        read_kv = self._registration.read_kv
        if not self._settings.verify_integrity or read_kv is None or self._registration.views:
            return (), 0
        try:
            src_ranges, dst_ranges = integrity.sample_ranges(plan.src, plan.dst, plan.length)
            return tuple(dst_ranges), integrity.checksum(src_ranges, read_kv)
        except Exception as exc:  # the bytes moved; only the proof of it is lost
            logger.warning("FlagCX integrity sample of %s not taken: %s",
                           pull.transfer_id, exc)
            return (), 0

    def _digests(self, send: Send, pull: hs.PullRequest) -> integrity.Digests:
        """Taken before the reply, like the byte sample (started at arm where the pairing
        was foreseen: ``integrity.DigestsAhead``). Without them decode fails the load as unproven,
        so a digest that cannot be taken is logged here."""
        if not self._settings.verify_integrity:
            return ()
        try:
            sender_ids = [list(g) for g in send.task.block_ids]
            receiver_ids, offsets = [list(g) for g in pull.block_ids], list(pull.offsets)
            paired = integrity.paired_sender_ids(sender_ids, receiver_ids, offsets)
            peer = (pull.sheet.tp_rank, pull.sheet.tp_size)
            self.ahead.learn(integrity.Pairing.of(peer, sender_ids, receiver_ids, offsets))
            early = self.ahead.take(send.digests_ahead, (peer, paired))
            return early if early is not None else self.ahead.digest(paired, peer)
        except Exception as exc:  # the bytes moved; only the proof of it is lost
            logger.warning("FlagCX integrity digest of %s not taken: %s",
                           pull.transfer_id, exc)
            return ()

    def _connection(self, sheet: hs.FactSheet) -> object:
        with self._connect_lock:  # writer threads: one connect per receiver
            handle = self._connections.get(sheet.incarnation)
            if handle is None:
                handle = self._transport.connect(sheet.transport_desc)
                self._connections[sheet.incarnation] = handle
            return handle
