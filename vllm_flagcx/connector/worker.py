"""Worker half of FlagCXConnector: one object per TP rank, composed of the parts that own
its state: what was registered (``registration.Registration``, frozen), prefill's
side-channel server (``prefill.server``) over the transfers it holds
(``sends.Sends``), decode's puller (``puller``), and the failure ledger (``faults``), with
the counters (``counters``) and histogram samples (``observations``) they share.

Protocol (P pushes, D initiates; the cross-engine key is the router-minted transfer id):

1. D learns P's fact sheet from P rank 0 (``HandshakeRequest``): TP size, layout facts.
   Incompatible peers are rejected with the differing field named.
2. Each D rank sends a ``PullRequest`` (its sheet, its block ids) to every P rank; a P rank
   holding none of its bytes (replicated heads) answers at once with an empty plan.
3. A P rank parks the pull until its scheduler armed the send, plans, writes through the
   transport, and answers ``PullReply`` per request. When every expected D rank pulled, P
   reports the request in ``finished_sending`` so vLLM frees its blocks.
4. A send never pulled expires after the lease (decode heartbeats renew it); a pull not
   answered in time fails on D once P acknowledged that no write is in flight. Every
   failure goes to the ``FailureLedger`` and ends the request (single-group models: its
   blocks in ``get_block_ids_with_load_errors``; hybrids: per request), so nothing waits
   forever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from vllm_flagcx.connector.common.counters import Counters, Observations
from vllm_flagcx.connector.common.metadata import FlagCXMetadataPayload, RequestId
from vllm_flagcx.connector.common.registration import Registration, register
from vllm_flagcx.connector.common.task_threads import InFlight
from vllm_flagcx.connector.common.worker_settings import WorkerSettings
from vllm_flagcx.connector.decode.faults import STAGES, FailureLedger
from vllm_flagcx.connector.decode.puller import Puller
from vllm_flagcx.connector.prefill.sends import Sends
from vllm_flagcx.connector.prefill.server import SideChannelServer
from vllm_flagcx.layout.regions import Region, kernel_ratios, model_page_bytes
from vllm_flagcx.transport.base import Transport
from vllm_flagcx.wire import handshake as hs
from vllm_flagcx.wire.metrics import Stat
from vllm_flagcx.wire.timeline import PullClock

logger = logging.getLogger("vllm_flagcx")
__all__ = ["STAGES", "WorkerHalf", "WorkerSettings", "kernel_ratios", "model_page_bytes"]


class WorkerHalf:
    """One per worker process (TP rank). Thread-safe between the runner and its threads."""

    def __init__(self, settings: WorkerSettings, transport: Transport) -> None:
        self.settings = settings
        self.transport = transport
        self.ledger = FailureLedger()
        self.stats = Counters()
        self.observations = Observations()  # histogram samples and gauges (wire.metrics)
        self.sends = Sends()  # prefill: armed transfers, their writes and how each ended
        self.registration: Registration | None = None
        self.server: SideChannelServer | None = None  # prefill
        self.puller: Puller | None = None  # decode (made at registration)
        self.in_flight = InFlight()  # pulls (decode) and writes (prefill) running now
        self._step_idle = False  # this step computes no token (its payload says)
        self._lock = threading.Lock()
        self._pending_invalid: set[int] = set()
        self.failed_last_step: set[RequestId] = set()  # vLLM request ids whose load failed

    # ---------------------------------------------------------------- registration
    def register_regions(self, regions: list[Region], serve: bool,
                         logical_num_blocks: int | None = None,
                         views: Mapping[str, Any] | None = None) -> None:
        """``views``: each layer as vLLM indexes it (``compat.kv_views``); without them
        the full logical digest is neither sent nor checked."""
        reg = register(self.settings, self.transport, regions, logical_num_blocks, views)
        self.registration = reg
        self.stats.set(Stat.REGISTERED_STORAGES, len(reg.storages))
        self.puller = Puller(self.settings, reg, self.ledger, self.stats, self.observations,
                             self.in_flight)
        if serve:
            self.server = SideChannelServer(self.settings, self.transport, reg, self.sends,
                                            self.stats, self.in_flight)
            self.server.start()

    @property
    def regions(self) -> list[Region]:
        return list(self.registration.regions) if self.registration else []

    @property
    def kernel_ratios(self) -> list[int]:
        return list(self.registration.kernel_ratios) if self.registration else []

    @property
    def sheet(self) -> hs.FactSheet | None:
        return self.registration.sheet if self.registration else None

    # ---------------------------------------------------------------- per step
    def start_step(self, payload: FlagCXMetadataPayload) -> None:
        self._step_idle = payload.idle
        armed = [self.sends.arm(task) for task in payload.send.values()]
        if payload.send and self.server is not None:  # None: a duplicate transfer id, done
            self.server.armed([send for send in armed if send is not None])
        if self.puller is None:  # vLLM registers the KV caches before any step
            for recv in payload.recv.values():
                self.ledger.record("recv", recv.request_id,
                                   [b for g in recv.block_ids for b in g],
                                   "a load was scheduled before register_kv_caches")
            return
        for recv in payload.recv.values():
            self.puller.submit_pull(recv)
        for transfer_id, remote in payload.release.items():
            self.puller.submit_release(transfer_id, remote)

    def get_finished(self) -> tuple[set[RequestId], set[RequestId]]:
        """(finished sending, finished receiving); failed receives are finished too, with
        their blocks held for ``get_block_ids_with_load_errors`` of the same step.

        A step that computes no token first waits (at most ``idle_step_wait_seconds``) for
        the transfers in flight, so they run without an engine loop spinning beside them
        and a load that ends meanwhile is reported now (``connector.in_flight``)."""
        if self._step_idle:
            self._step_idle = False
            waited = self.in_flight.wait_idle(self.settings.idle_step_wait_seconds)
            if waited:
                self.stats.add(Stat.IDLE_STEP_WAITS)
        self.stats.add(Stat.EXPIRED_LEASES, self.sends.expire(time.monotonic()))
        failed, blocks = self.ledger.drain()
        loaded = self.puller.take_finished() if self.puller is not None else {}
        with self._lock:
            self._pending_invalid |= blocks
            self.failed_last_step = failed
        sending = self.sends.take_done()
        self._log_timelines(loaded)
        return sending, set(loaded) | failed

    def _log_timelines(self, loaded: Mapping[RequestId, PullClock | None]) -> None:
        """One ``wire.timeline`` line per load reported now (INFO with
        ``log_timelines``, else DEBUG)."""
        level = logging.INFO if self.settings.log_timelines else logging.DEBUG
        if not loaded or not logger.isEnabledFor(level):
            return
        reported = time.monotonic()
        for request_id, clock in loaded.items():
            if clock is not None:
                logger.log(level, "%s", clock.line(request_id, reported))

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            invalid, self._pending_invalid = self._pending_invalid, set()
        return invalid

    def take_stats(self) -> dict[str, Any]:
        """Transfer counters since the previous call, with the histogram samples and the
        gauges of ``observations`` (the keys of ``wire.metrics``)."""
        delta: dict[str, Any] = dict(self.stats.take_delta())
        delta.update(self.observations.take(pending_sends=len(self.sends)))
        return delta

    # ---------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        if self.server is not None:
            self.server.shutdown()
        if self.puller is not None:
            self.puller.shutdown()
        self.transport.close()
