"""Prefill's writes: one claimed pull planned, checked, written and answered, with the
integrity samples taken before the reply (the blocks may be reused right after it).

Part of the side-channel server (``side_channel_server``), which claims a pull and hands
it here on a writer thread; apart because the write path is its own responsibility: the
plan, the bounds check, the transport, the samples, and the rule that a write which
waited too long, or whose transfer decode released meanwhile, never starts.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm_flagcx.connector import integrity
from vllm_flagcx.connector.sends import Send
from vllm_flagcx.layout import plans
from vllm_flagcx.wire import handshake as hs

logger = logging.getLogger("vllm_flagcx")


class SideChannelWrites:
    """The write half of ``SideChannelServer`` (state created in ``WorkerHalf``)."""

    settings: Any
    views: dict[str, Any]
    transport: Any
    stats: Any

    def _write_job(self, ident: bytes, send: Send, pull: hs.PullRequest,
                   claimed_at: float) -> None:
        """One claimed write, finished exactly once whatever happens (``Sends.finish``), and
        only then answered: the Releases it held back are acknowledged after it.

        A write that waited behind busy writers does not start once decode released the
        transfer, nor later than ``write_start_timeout`` after its claim: decode may have
        given up on it by then, and a late write would land in blocks vLLM reused."""
        reply = hs.PullReply(pull.transfer_id, False, "write not run")
        try:
            waited = time.monotonic() - claimed_at
            if not self.sends.may_start(send):
                reply = hs.PullReply(pull.transfer_id, False, "released by decode before "
                                     "this write started: not written")
            elif waited > self.settings.write_start_timeout:
                reply = hs.PullReply(pull.transfer_id, False, (
                    f"this write waited {waited:.1f} s for a writer (more than "
                    f"write_start_timeout={self.settings.write_start_timeout:g} s): not "
                    "written"))
            else:
                reply = self._write(send, pull, waited)
        except Exception as exc:  # the last guard: the claim is still finished below
            logger.warning("FlagCX write for %s: %s: %s", pull.transfer_id,
                           type(exc).__name__, exc)
            reply = hs.PullReply(pull.transfer_id, False, f"{type(exc).__name__}: {exc}")
        finally:
            if not reply.ok:
                with self._lock:
                    self.stats["send_failures"] += 1
            waiters = self.sends.finish(pull.transfer_id, send, pull.sheet.tp_rank,
                                        pull.sheet.tp_size)
        self._post(ident, reply)
        for waiter in waiters:
            self._post(waiter, hs.Ack(pull.transfer_id))

    def _write(self, send: Send, pull: hs.PullRequest, waited: float = 0.0) -> hs.PullReply:
        started = time.monotonic()
        try:
            hs.check_compatible(self.sheet, pull.sheet, skip_hash=self.settings.skip_compat_hash)
            receiver = self._receivers.get(pull.sheet, self.regions)
            plan = receiver.table.plan(
                send.task.block_ids, pull.block_ids, self.kernel_ratios or None,
                list(pull.offsets) or None)
            plans.check_within(plan, self._storages, receiver.spans)
            if plan.num_descriptors == 0:  # this rank holds none of the receiver's bytes
                return hs.PullReply(pull.transfer_id, True)
            handle = self._connection(receiver.sheet)
            result = self.transport.write(handle, plan.src, plan.dst, plan.length)
        except Exception as exc:  # whatever a pull names, the transfer ends and is freed
            self._connections.pop(pull.sheet.incarnation, None)
            return hs.PullReply(pull.transfer_id, False, f"{type(exc).__name__}: {exc}")
        if not result.ok:
            self._connections.pop(pull.sheet.incarnation, None)
            return hs.PullReply(pull.transfer_id, False, result.error)
        written = time.monotonic()
        with self._lock:
            self.stats["send_bytes"] += plan.num_bytes
            self.stats["send_descriptors"] += plan.num_descriptors
            self.stats["send_seconds"] += written - started
        sample, crc = (), 0
        if self.settings.verify_integrity and self._read_kv is not None:
            # Read before the pull ends: the blocks may be freed (and reused) right after.
            try:
                src_ranges, dst_ranges = integrity.sample_ranges(plan.src, plan.dst,
                                                                 plan.length)
                sample, crc = tuple(dst_ranges), integrity.checksum(src_ranges, self._read_kv)
            except Exception as exc:  # the bytes moved; only the proof of it is lost
                logger.warning("FlagCX integrity sample of %s not taken: %s",
                               pull.transfer_id, exc)
        logical = self._logical_sample(send, pull)
        return hs.PullReply(pull.transfer_id, True, "", plan.num_bytes, plan.num_descriptors,
                            sample, crc, logical,
                            (waited, written - started, time.monotonic() - written))

    def _logical_sample(self, send: Send, pull: hs.PullRequest
                        ) -> tuple[integrity.LogicalEntry, ...]:
        if not self.settings.verify_integrity:
            return ()
        try:
            return integrity.logical_sample(
                self.views, [list(g) for g in send.task.block_ids],
                [list(g) for g in pull.block_ids], list(pull.offsets),
                self.settings.tp_rank, self.settings.tp_size, pull.sheet.tp_rank,
                pull.sheet.tp_size)
        except Exception as exc:  # the bytes moved; only the proof of it is lost
            logger.warning("FlagCX logical integrity sample of %s not taken: %s",
                           pull.transfer_id, exc)
            return ()

    def _connection(self, sheet: hs.FactSheet) -> object:
        with self._connect_lock:  # writer threads: one connect per receiver
            handle = self._connections.get(sheet.incarnation)
            if handle is None:
                handle = self.transport.connect(sheet.transport_desc)
                self._connections[sheet.incarnation] = handle
            return handle

    def _expire_leases(self) -> None:
        expired = self.sends.expire(time.monotonic())
        with self._lock:
            self.stats["expired_leases"] += expired

