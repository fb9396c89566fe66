"""Decode's puller: handshake with prefill, pull every prefill rank, verify, release.

Each pull runs on one of its kept threads (``connector.task_threads``) and always
ends its request: finished (``take_finished``) or failed in the ``FailureLedger`` after
prefill confirmed that no write is in flight (``_fail_after_release``); an unexpected error
fails it too (``_pull_guarded``). A reply's integrity sample is read only inside this worker's own
registered KV caches.

It owns its side-channel connections (one kept per prefill rank), the cached fact sheets
of the prefills it pulls from, its threads and the loads finished since the last step; the
ledger, counters and observations are shared with the worker that built it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from vllm_flagcx.connector.common import integrity
from vllm_flagcx.connector.common.counters import Counters, Observations
from vllm_flagcx.connector.common.metadata import RecvTask, RequestId, TransferId
from vllm_flagcx.connector.common.registration import Registration
from vllm_flagcx.connector.common.task_threads import InFlight, TaskThreads
from vllm_flagcx.connector.common.worker_settings import WorkerSettings
from vllm_flagcx.connector.decode import faults
from vllm_flagcx.connector.decode.faults import FailureLedger
from vllm_flagcx.wire import client
from vllm_flagcx.wire import handshake as hs
from vllm_flagcx.wire import params as wire_params
from vllm_flagcx.wire.metrics import Stat
from vllm_flagcx.wire.params import RemotePrefill
from vllm_flagcx.wire.timeline import PullClock

logger = logging.getLogger("vllm_flagcx")

SLOW_HANDSHAKE_SECONDS = 1.0


class Puller:
    """Decode's loads for one TP rank (see the module docstring)."""

    def __init__(self, settings: WorkerSettings, registration: Registration,
                 ledger: FailureLedger, counters: Counters,
                 observations: Observations, in_flight: InFlight) -> None:
        self._settings = settings
        self._in_flight = in_flight  # this worker's pulls, for its idle steps
        self._registration = registration
        self._ledger = ledger
        self._counters = counters
        self._observations = observations
        self._lock = threading.Lock()
        self._zmq: Any = None  # zmq.Context, made by the first pull (imports stay cheap)
        self._channels: client.Channels | None = None  # kept side-channel connections
        self._peer_sheets: dict[tuple[str, int], tuple[float, hs.FactSheet]] = {}
        self._finished: dict[RequestId, PullClock | None] = {}  # until take_finished
        self._tasks = TaskThreads()  # pulls and releases run on kept threads
        self._stop = threading.Event()

    def submit_pull(self, task: RecvTask) -> None:
        self._in_flight.begin()  # ended by _pull_guarded, whatever happens in it
        try:
            self._tasks.submit(self._pull_guarded, task)
        except BaseException:
            self._in_flight.end()
            raise

    def submit_release(self, transfer_id: TransferId, remote: RemotePrefill) -> None:
        self._tasks.submit(self._release, transfer_id, remote,
                           self._settings.handshake_timeout)

    def take_finished(self) -> dict[RequestId, PullClock | None]:
        """Loads that ended since the previous call, each with its clock (None: ended
        without a pull, e.g. dropped by a test fault)."""
        with self._lock:
            finished, self._finished = self._finished, {}
        return finished

    def shutdown(self) -> None:
        self._stop.set()
        self._tasks.shutdown(timeout=2.0)
        if self._channels is not None:
            self._channels.close()
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None

    def _ask(self, host: str, port: int, message: hs.Message, timeout: float) -> hs.Message:
        """One exchange with a prefill rank over the connection kept for it."""
        import zmq

        with self._lock:  # pull threads start at once; one context and pool for all
            if self._zmq is None:
                self._zmq = zmq.Context()
            if self._channels is None:
                self._channels = client.Channels(self._zmq)
            channels = self._channels
        return channels.ask(host, port, message, timeout,
                            probe_every=self._settings.peer_probe_seconds,
                            key=self._settings.key)

    def _remote_sheet(self, host: str, port: int) -> hs.FactSheet:
        key = (host, port)
        cached = self._peer_sheets.get(key)
        if cached is None or time.monotonic() - cached[0] > self._settings.peer_ttl:
            started = time.monotonic()
            reply = self._ask(host, port, hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0),
                              self._settings.handshake_timeout)
            took = time.monotonic() - started
            self._observations.observe("handshake_seconds", took)
            if took > SLOW_HANDSHAKE_SECONDS:
                logger.warning("FlagCX handshake with prefill %s:%d took %.1f s (a busy or "
                               "CPU-starved prefill worker answers late)", host, port, took)
            if isinstance(reply, hs.HandshakeRefused):
                raise hs.HandshakeError(f"prefill at {host}:{port} refused: {reply.reason}")
            if not isinstance(reply, hs.HandshakeReply):
                raise hs.HandshakeError(f"unexpected handshake answer {type(reply).__name__}")
            self._peer_sheets[key] = (time.monotonic(), reply.sheet)
        return self._peer_sheets[key][1]

    def _pull_guarded(self, task: RecvTask) -> None:
        """``_pull``, and whatever it raises (a bug, a value nobody checked) fails the
        request: a pull thread that died silently left its request waiting forever with
        its blocks."""
        self._observations.pull_started()
        try:
            self._pull(task)
        except Exception as exc:
            flat = [b for g in task.block_ids for b in g]
            error = f"internal error in the pull: {type(exc).__name__}: {exc}"
            try:
                self._fail_after_release(task, flat, error)
            except Exception:
                self._ledger.record("recv", task.request_id, flat, error)
        finally:
            self._observations.pull_ended()
            self._in_flight.end()

    def _pull(self, task: RecvTask) -> None:
        reg = self._registration
        flat = [b for g in task.block_ids for b in g]
        remote = task.remote
        started = time.monotonic()
        clock = PullClock(remote.transfer_id, task.planned_at or started, started)
        try:
            fault = faults.requested_fault(remote.test_fault, self._settings.test_faults)
        except faults.FaultKnobError as exc:
            self._fail_after_release(task, flat, str(exc))
            return
        if fault == "drop_all":
            self._release(remote.transfer_id, remote, self._settings.handshake_timeout)
            with self._lock:
                self._finished[task.request_id] = None
            return
        p_sheet = self._prefill_sheet(task, flat)
        if p_sheet is None:
            return
        clock.sheet = time.monotonic()
        # Every P rank is asked, also those holding nothing for this rank (replicated
        # heads): they answer at once, and each P rank then knows when all D ranks pulled.
        senders = range(p_sheet.tp_size)
        request = hs.PullRequest(remote.transfer_id, reg.sheet,
                                 tuple(tuple(g) for g in task.block_ids),
                                 tuple(task.offsets))
        total = 0
        for p_rank in senders:
            asked = time.monotonic()
            try:
                reply = self._ask(remote.remote_host, remote.remote_port + p_rank, request,
                                  self._settings.recv_timeout)
                waited = time.monotonic() - asked
                clock.asking += waited
            except (TimeoutError, OSError, hs.HandshakeError) as exc:
                self._fail_after_release(task, flat, f"P rank {p_rank}: {exc}")
                return
            checking = time.monotonic()
            problem = self._reply_problem(p_rank, reply, remote.transfer_id)
            clock.bytes_check += time.monotonic() - checking
            if problem is not None or not isinstance(reply, hs.PullReply):
                self._fail_after_release(task, flat, problem or "not a pull reply")
                return
            checking = time.monotonic()
            problem = self._digest_problem(task, p_rank, p_sheet.tp_size, reply)
            clock.digest += time.monotonic() - checking
            if problem is not None:
                self._fail_after_release(task, flat, problem)
                return
            if clock.add_prefill(reply.timings) and reply.num_bytes:
                self._observe_transfer(reply, waited)
            total += reply.num_bytes
        if total <= 0 < len(flat):
            # every rank "succeeded" and nothing moved: the blocks hold whatever they held
            self._fail_after_release(task, flat, f"{len(senders)} prefill rank(s) answered "
                                     f"ok with 0 bytes for {len(flat)} blocks: nothing loaded")
            return
        if fault == "corrupt_block":
            faults.corrupt_first_block(
                list(reg.regions), task.block_ids,
                faults.memory_filler(self._settings.host_memory))
        clock.verified = time.monotonic()
        self._observations.observe("pull_seconds", clock.verified - started)
        with self._lock:
            self._finished[task.request_id] = clock

    def _observe_transfer(self, reply: hs.PullReply, waited: float) -> None:
        """One prefill rank's write as NIXL observes a transfer (``wire.metrics``): its
        data movement (prefill's write), the rest of the wait (round trip and queue,
        this side's checks excluded), bytes and descriptors."""
        write, sample = reply.timings[1], reply.timings[2]
        self._observations.observe("xfer_time", write)
        self._observations.observe("post_time", max(0.0, waited - write - sample))
        self._observations.observe("bytes_transferred", reply.num_bytes)
        self._observations.observe("num_descriptors", reply.num_descriptors)

    def _prefill_sheet(self, task: RecvTask, flat: list[int]) -> hs.FactSheet | None:
        """The fact sheet of the prefill ``task`` names, checked against this worker's; None
        when the handshake failed (the request is failed in the ledger)."""
        remote = task.remote
        try:
            p_sheet = self._remote_sheet(remote.remote_host, remote.remote_port)
            if p_sheet.engine_id != remote.remote_engine_id:  # a cached sheet may be old
                self._peer_sheets.pop((remote.remote_host, remote.remote_port), None)
                p_sheet = self._remote_sheet(remote.remote_host, remote.remote_port)
            if p_sheet.engine_id != remote.remote_engine_id:
                raise hs.HandshakeError(
                    f"prefill at {remote.remote_host}:{remote.remote_port} is engine "
                    f"{p_sheet.engine_id!r}, the request's kv_transfer_params name "
                    f"remote_engine_id={remote.remote_engine_id!r}: that port serves another "
                    "instance (pass prefill's returned kv_transfer_params unchanged)")
            hs.check_compatible(self._registration.sheet, p_sheet,
                                skip_hash=self._settings.skip_compat_hash)
            return p_sheet
        except (hs.HandshakeError, TimeoutError, OSError) as exc:
            self._peer_sheets.pop((remote.remote_host, remote.remote_port), None)
            self._ledger.record("handshake", task.request_id, flat,
                                str(exc) + wire_params.loopback_hint(remote.remote_host))
            if isinstance(exc, hs.HandshakeError):  # P is reachable: let it free now
                self._release(remote.transfer_id, remote, self._settings.handshake_timeout)
            return None

    def _reply_problem(self, p_rank: int, reply: hs.Message, transfer_id: str) -> str | None:
        """Why prefill rank ``p_rank``'s answer does not prove the load (None: it does): a
        refusal, an answer to another pull, or an integrity sample that is missing, names
        memory outside this worker's KV caches, or does not match."""
        if not isinstance(reply, hs.PullReply) or not reply.ok:
            return f"P rank {p_rank}: {getattr(reply, 'error', type(reply).__name__)}"
        if reply.transfer_id != transfer_id:  # an answer to another pull
            return (f"P rank {p_rank} answered for transfer {reply.transfer_id!r}, not "
                    f"{transfer_id!r}: the reply is not this request's")
        checked = self._integrity_checked()
        # the full digest, checked after this, covers every byte: prefill sends no byte
        # sample with it (only where this rank can check the digest does its absence pass)
        digested = bool(reply.digests) and bool(self._registration.views)
        if checked and reply.num_descriptors and not reply.sample and not digested:
            self._counters.add(Stat.INTEGRITY_FAILURES)
            return (f"P rank {p_rank} wrote {reply.num_descriptors} descriptors and sent no "
                    "integrity sample: the load is unproven (is verify_integrity false on "
                    "prefill? set it the same on both instances)")
        read_kv = self._registration.read_kv
        if not (reply.sample and checked and read_kv is not None):
            return None
        stray = integrity.outside(list(reply.sample), self._registration.storages)
        if stray is not None:
            return (f"P rank {p_rank}: the reply's integrity sample names {stray[1]} bytes at "
                    f"{stray[0]:#x}, outside this worker's KV caches")
        got = integrity.checksum(list(reply.sample), read_kv)
        if got != reply.sample_crc:
            self._counters.add(Stat.INTEGRITY_FAILURES)
            return (f"P rank {p_rank}: integrity check failed (crc {got:#x} != "
                    f"{reply.sample_crc:#x}): the transport reported success but bytes did "
                    "not land")
        return None

    def _digest_problem(self, task: RecvTask, p_rank: int, p_tp: int,
                        reply: hs.PullReply) -> str | None:
        """Whether everything prefill rank ``p_rank`` wrote is what this rank's blocks
        hold now (its write is complete when it replies): the full digest per layer."""
        views = self._registration.views
        if not (self._settings.verify_integrity and views):
            return None
        s = self._settings
        mismatch = integrity.receiver_mismatch(
            views, reply.digests, [list(g) for g in task.block_ids], (s.tp_rank, s.tp_size),
            (p_rank, p_tp))
        self._counters.add(Stat.INTEGRITY_DIGEST_LAYERS, len(reply.digests))
        if mismatch is None:
            return None
        self._counters.add(Stat.INTEGRITY_FAILURES)
        return f"P rank {p_rank}: {mismatch}"

    def _integrity_checked(self) -> bool:
        if not self._settings.verify_integrity:
            return False
        if self._registration.read_kv is None:
            if not self._counters.get("integrity_skipped_device"):
                logger.info("FlagCX integrity check skipped: device memory that the CUDA "
                            "driver cannot read")
            self._counters.set(Stat.INTEGRITY_SKIPPED_DEVICE, 1)
            return False
        return True

    def _fail_after_release(self, task: RecvTask, flat: list[int], error: str) -> None:
        """Fail a pull only once prefill confirmed no write into these blocks is in flight.

        A pull that timed out may still be written by a slow prefill; reporting it now
        would let vLLM reuse the blocks under that write. Each prefill rank handles its
        side channel in order, so its Ack to the Release comes after any write it had
        under way. The wait is bounded by the lease, and ends at once when prefill's port
        refuses connections (its worker, the writer, is gone: ``client.PeerGoneError``).
        """
        hold_until = time.monotonic() + self._settings.release_hold_seconds
        confirmed = self._release(task.remote.transfer_id, task.remote,
                                  self._settings.lease_seconds)
        while not confirmed and not self._stop.is_set():
            # A write may still land: the blocks stay ours until prefill says none is in
            # flight or its port refuses connections (``_release``), up to the hold.
            left = hold_until - time.monotonic()
            if left <= 0:
                break
            self._counters.add(Stat.RELEASE_RETRIES)
            confirmed = self._release(task.remote.transfer_id, task.remote,
                                      min(self._settings.lease_seconds, left))
        if not confirmed:
            self._counters.add(Stat.FAILED_NOTIFICATIONS)
            error += (f"; prefill did not confirm within release_hold_seconds="
                      f"{self._settings.release_hold_seconds:g} that no write is in flight")
            logger.error("FlagCX: %s: blocks of request %s go back to vLLM unconfirmed: %s",
                         task.remote.transfer_id, task.request_id, error)
        self._ledger.record("recv", task.request_id, flat, error)

    def _release(self, transfer_id: TransferId, remote: RemotePrefill, timeout: float) -> bool:
        """Tell every prefill rank to drop ``transfer_id``; True when each acknowledged
        or is gone (its port refuses connections: nothing left there to write)."""
        try:
            p_sheet = self._remote_sheet(remote.remote_host, remote.remote_port)
            for p_rank in range(p_sheet.tp_size):
                try:
                    self._ask(remote.remote_host, remote.remote_port + p_rank,
                              hs.Release(transfer_id), timeout)
                except client.PeerGoneError:
                    continue
        except (hs.HandshakeError, TimeoutError, OSError) as exc:
            # Prefill frees the blocks at lease expiry anyway.
            logger.info("release of %s not acknowledged (%s); the prefill lease frees it",
                        transfer_id, exc)
            return False
        return True
