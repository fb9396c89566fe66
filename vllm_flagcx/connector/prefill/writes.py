"""Prefill's writes: one claimed pull planned, checked, written and answered, with the
integrity samples taken before the reply (the blocks may be reused right after it).

The side-channel server (``prefill.server``) claims a pull and hands it here on a
writer thread; apart because the write path is its own responsibility: the plan, the
bounds check, the transport and its connections, the samples, and the rule that a write
which waited too long, or whose transfer decode released meanwhile, never starts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from vllm_flagcx.connector.common import integrity
from vllm_flagcx.connector.common.counters import Counters
from vllm_flagcx.connector.common.registration import Registration
from vllm_flagcx.connector.common.worker_settings import WorkerSettings
from vllm_flagcx.connector.prefill.pulls import ReceiverCache
from vllm_flagcx.connector.prefill.sends import Send, Sends
from vllm_flagcx.layout import bounds, plans
from vllm_flagcx.transport.base import Transport
from vllm_flagcx.wire import handshake as hs
from vllm_flagcx.wire.metrics import Stat

logger = logging.getLogger("vllm_flagcx")

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
        """Read before the pull ends: the blocks may be freed (and reused) right after."""
        read_kv = self._registration.read_kv
        if not self._settings.verify_integrity or read_kv is None:
            return (), 0
        try:
            src_ranges, dst_ranges = integrity.sample_ranges(plan.src, plan.dst, plan.length)
            return tuple(dst_ranges), integrity.checksum(src_ranges, read_kv)
        except Exception as exc:  # the bytes moved; only the proof of it is lost
            logger.warning("FlagCX integrity sample of %s not taken: %s",
                           pull.transfer_id, exc)
            return (), 0

    def _digests(self, send: Send, pull: hs.PullRequest) -> tuple[tuple[str, int], ...]:
        """Taken before the reply, like the byte sample. Without them decode fails the
        load as unproven, so a digest that cannot be taken is logged here."""
        if not self._settings.verify_integrity:
            return ()
        s = self._settings
        try:
            return integrity.sender_digests(
                self._registration.views, [list(g) for g in send.task.block_ids],
                [list(g) for g in pull.block_ids], list(pull.offsets),
                (s.tp_rank, s.tp_size), (pull.sheet.tp_rank, pull.sheet.tp_size))
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
