"""The entry class vLLM instantiates, once per role (scheduler process, each worker).

It dispatches every hook to the half for its role; both halves are written against
``vllm_flagcx.compat`` only. The transport is injected: ``kv_connector_extra_config``
``transport`` names one (flagcx | local | auto), or ``transport_factory`` a
``module:callable`` taking ``(vllm_config, tp_rank)``.
Nothing is started at import time; the worker half starts its side channel when the KV
caches are registered.
"""

from __future__ import annotations

import logging
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

from vllm_flagcx.compat import config as compat_config
from vllm_flagcx.compat import kv_cache as compat_kv
from vllm_flagcx.compat.connector_api import (
    FlagCXPromMetrics,
    KVConnectorMetadata,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    PortableConnectorBase,
    SummedConnectorStats,
    role_is_scheduler,
    step_computes_nothing,
    transfer_results,
)
from vllm_flagcx.compat.kv_cache import (
    hma_state,
    require_hma_for_mamba,
    require_hybrid_async_load,
    require_mamba_align_accepts_remote_loads,
)
from vllm_flagcx.compat.plugin import adopt_vllm_logging
from vllm_flagcx.compat.vllm_types import KVCacheConfigLike, VllmRequest
from vllm_flagcx.compat.vllm_writes import (
    SCHEDULER_FLAG,
    LoadFailureRecovery,
    handed_over_scheduler,
    report_as_sent,
)
from vllm_flagcx.connector.common.metadata import FlagCXMetadataPayload, RequestId
from vllm_flagcx.connector.common.settings import (
    ConnectorSettings,
    SettingsError,
)
from vllm_flagcx.connector.common.transport_choice import make_transport
from vllm_flagcx.connector.scheduler import (
    SchedulerHalf,
    SchedulerSettings,
    reports_failures_per_request,
)
from vllm_flagcx.wire import auth

if TYPE_CHECKING:
    from vllm_flagcx.connector.worker import WorkerHalf

logger = logging.getLogger("vllm_flagcx")

class FlagCXConnectorMetadata(KVConnectorMetadata):
    """Per-step scheduler -> worker metadata: what to receive, send and release."""

    def __init__(self, payload: FlagCXMetadataPayload | None = None) -> None:
        self.payload = payload or FlagCXMetadataPayload()

    @property
    def preempted_req_ids(self) -> set[RequestId]:
        return self.payload.preempted_req_ids

    @preempted_req_ids.setter
    def preempted_req_ids(self, value: set[str]) -> None:
        self.payload.preempted_req_ids = {RequestId(r) for r in value}


class FlagCXWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc, valid-type]
    """Worker -> scheduler: requests whose receive failed this step (hybrid models)."""

    def __init__(self, failed_recving: AbstractSet[str] | None = None) -> None:
        self.failed_recving = set(failed_recving or ())

    def aggregate(self, other: FlagCXWorkerMetadata) -> FlagCXWorkerMetadata:
        return FlagCXWorkerMetadata(self.failed_recving | other.failed_recving)


_LOGGED: set[str] = set()


def log_capabilities_once(vllm_config: object, engine_id: str, group_kinds: list[str]) -> None:
    """One line with what was resolved: a silent capability change is a bug."""
    if engine_id in _LOGGED:
        return
    _LOGGED.add(engine_id)
    from vllm_flagcx.compat import probe, version

    v = version.installed_version()
    vendor = version.classify_vendor(probe.installed_platform_traits(), v)
    logger.info("FlagCXConnector: vLLM %s (vendor %s), HMA %s, conv layout %s, KV cache "
                "groups %s, engine %s", v.raw, vendor, hma_state(vllm_config),
                compat_kv.conv_state_layout(), group_kinds, engine_id)


def side_channel_base(base_port: int, dp_rank: int, tp_size: int) -> int:
    """The first side-channel port of this DP rank: ``base + dp_rank x TP`` (its TP ranks
    listen on that + rank); SettingsError naming the setting when that runs past 65535."""
    first = base_port + dp_rank * tp_size
    if first + tp_size - 1 > 65535:
        raise SettingsError(
            f"kv_connector_extra_config.side_channel_port={base_port}: with TP {tp_size} "
            f"and DP rank {dp_rank} the side channel would need ports up to "
            f"{first + tp_size - 1}; use a lower base port")
    return first


class FlagCXConnector(PortableConnectorBase):
    """Prefill/decode KV connector over FlagCX (HMA-aware: one block list per group)."""

    def __init__(self, vllm_config: Any, role: object,
                 kv_cache_config: KVCacheConfigLike | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        adopt_vllm_logging()
        require_hma_for_mamba(vllm_config, kv_cache_config)
        require_hybrid_async_load(bool(vllm_config.kv_transfer_config.is_kv_consumer),
                                  kv_cache_config)
        require_mamba_align_accepts_remote_loads(
            bool(vllm_config.kv_transfer_config.is_kv_consumer), vllm_config, kv_cache_config)
        self.is_scheduler = role_is_scheduler(role)
        ktc = vllm_config.kv_transfer_config
        # Every key checked once, here, at startup (connector.settings says why).
        self.settings = ConnectorSettings.from_extra(
            getattr(ktc, "kv_connector_extra_config", None))
        parallel = vllm_config.parallel_config
        self.tp_size = int(parallel.tensor_parallel_size)
        self.side_channel_port = side_channel_base(self.settings.side_channel_port,
                                                   compat_config.dp_index(parallel),
                                                   self.tp_size)
        self.engine_id = str(getattr(ktc, "engine_id", None) or "flagcx")
        # The side channel's MAC key (wire.auth): loaded once, never logged.
        self._key = auth.load_key(self.settings.side_channel_secret_file)
        self.scheduler: SchedulerHalf | None = None
        self.worker: WorkerHalf | None = None
        if self.is_scheduler:
            self.scheduler = self._make_scheduler(vllm_config, kv_cache_config)
        elif ktc.is_kv_producer:  # before the model loads: a taken port is found at once
            from vllm_flagcx.connector.prefill.gate import check_free

            rank = compat_config.tp_rank()
            check_free(self.settings.bind_host, self.side_channel_port + rank, rank,
                       self._key is not None)
        self._metadata_payload: FlagCXMetadataPayload | None = None
        # How failed receives are reported (connector.scheduler says why); fixed per model.
        self._failures_per_request = reports_failures_per_request(
            compat_kv.group_facts(kv_cache_config) if kv_cache_config else [])

    def _make_scheduler(self, vllm_config: Any, kv_cache_config: KVCacheConfigLike | None
                        ) -> SchedulerHalf:
        """The scheduler half, with the scheduler constructing us if it handed itself over;
        a sliding-window decode without a clean recompute path is refused (``vllm_writes``)."""
        recovery = LoadFailureRecovery(handed_over_scheduler())
        half = SchedulerHalf(SchedulerSettings(
            engine_id=self.engine_id, side_channel_host=self.settings.side_channel_host,
            side_channel_port=self.side_channel_port, tp_size=self.tp_size,
            lease_seconds=self.settings.lease_seconds,
            first_lease_seconds=self.settings.initial_lease, key=self._key),
            kv_cache_config, recovery)
        if (bool(vllm_config.kv_transfer_config.is_kv_consumer) and half.has_sliding
                and recovery.mode is None):
            raise RuntimeError(
                "FlagCXConnector (decode): a failed KV load of this sliding-window model "
                "must recompute over a clean block table, which this vLLM build lets a "
                "connector do only through its scheduler. Fix: start decode with "
                f"{SCHEDULER_FLAG}, or use vLLM >= 0.30 for decode (`vllm-flagcx doctor`).")
        log_capabilities_once(vllm_config, self.engine_id,
                              [g.kind.value for g in half.groups])
        return half

    # ---------------------------------------------------------------- scheduler side
    def _scheduler_half(self) -> SchedulerHalf:
        if self.scheduler is None:
            raise RuntimeError("FlagCXConnector: a scheduler-side call on the worker-role "
                               "connector (vLLM builds one of each role)")
        return self.scheduler

    def on_new_request(self, request: VllmRequest) -> None:
        """vLLM 0.22+ calls this first for a new request (0.34: before its own code reads
        ``kv_transfer_params`` as a mapping): non-object params (reachable through
        ``vllm_xargs``) are dropped here with a warning instead of crashing the engine, and
        a decode request tells its prefill at once that it arrived (``first_lease_seconds``)."""
        if self.scheduler is not None:
            self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: VllmRequest, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._scheduler_half().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: VllmRequest, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._scheduler_half().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: object) -> KVConnectorMetadata:
        return FlagCXConnectorMetadata(
            self._scheduler_half().build_payload(idle=step_computes_nothing(scheduler_output)))

    def request_finished_all_groups(self, request: VllmRequest, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, object] | None]:
        return self._scheduler_half().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: object) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        freed_as_sent = self._scheduler_half().update_connector_output(
            getattr(connector_output, "finished_sending", None),
            getattr(connector_output, "finished_recving", None),
            meta.failed_recving if isinstance(meta, FlagCXWorkerMetadata) else None)
        report_as_sent(connector_output, freed_as_sent)

    def on_preemptions(self, req_ids: set[str]) -> None:
        if self.scheduler is not None:
            self.scheduler.on_preemptions(req_ids)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: object) -> str | None:
        from vllm_flagcx.compat.attention import required_kv_layout_name

        model = getattr(vllm_config, "model_config", None)
        return required_kv_layout_name(is_mla=bool(getattr(model, "use_mla", False)))

    # ---------------------------------------------------------------- worker side
    def _make_worker(self, regions: list[Any], host_memory: bool) -> WorkerHalf:
        from vllm_flagcx.connector.common.worker_setup import layout_facts
        from vllm_flagcx.connector.worker import WorkerHalf, WorkerSettings

        rank = compat_config.tp_rank()
        transport = make_transport(self.settings, self._vllm_config, rank, host_memory)
        settings = WorkerSettings(
            engine_id=self.engine_id, tp_rank=rank, tp_size=self.tp_size,
            layout=layout_facts(self._vllm_config, self.kv_cache_config, regions),
            bind_host=self.settings.bind_host,
            side_channel_port=self.side_channel_port,
            handshake_timeout=self.settings.handshake_timeout,
            recv_timeout=self.settings.pull_timeout,
            lease_seconds=self.settings.lease_seconds,
            write_start_timeout=self.settings.write_start_timeout,
            release_hold_seconds=self.settings.release_hold_seconds,
            idle_step_wait_seconds=self.settings.idle_step_wait_seconds,
            skip_compat_hash=not self.settings.enforce_handshake_compat,
            verify_integrity=self.settings.verify_integrity,
            host_memory=host_memory,
            test_faults=self.settings.test_faults,
            log_timelines=self.settings.log_timelines, key=self._key)
        return WorkerHalf(settings, transport)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm_flagcx.connector.common.worker_setup import (
            attention_dims,
            kv_cache_regions,
            kv_cache_views,
            start_line,
            warn_on_cpu_binding,
        )

        dims = attention_dims(self._vllm_config, self.kv_cache_config)
        regions = kv_cache_regions(self._vllm_config, self.kv_cache_config, self.tp_size,
                                   kv_caches, dims)
        first = next(iter(kv_caches.values()))
        first = first[0] if isinstance(first, (list, tuple)) else first
        host_memory = first.device.type == "cpu"
        self.worker = self._make_worker(regions, host_memory)
        ktc = self._vllm_config.kv_transfer_config
        self.worker.register_regions(
            regions, serve=bool(ktc.is_kv_producer),
            logical_num_blocks=self.kv_cache_config.num_blocks,
            views=kv_cache_views(self._vllm_config, self.kv_cache_config, kv_caches, dims,
                                 regions, self.tp_size))
        logger.info(start_line(
            role="prefill" if ktc.is_kv_producer else "decode",
            tp_rank=self.worker.settings.tp_rank, transport=self.worker.transport.name,
            advertised_host=self.settings.side_channel_host,
            bind_host=self.settings.bind_host,
            port=self.side_channel_port + self.worker.settings.tp_rank,
            host_memory=host_memory, secret=self._key is not None))
        warn_on_cpu_binding(host_memory)

    def start_load_kv(self, forward_context: object, **kwargs: object) -> None:
        meta = self._get_connector_metadata()
        if self.worker is not None and isinstance(meta, FlagCXConnectorMetadata):
            self.worker.start_step(meta.payload)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: object, attn_metadata: object,
                      **kwargs: object) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[RequestId] | None,
                                                                 set[RequestId] | None]:
        if self.worker is None:
            return None, None
        sending, recving = self.worker.get_finished()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Failed blocks, for single-group models (vLLM maps them back to requests only
        there); hybrids report failed requests instead (worker meta / failed_recving)."""
        if self.worker is None:
            return set()
        blocks = self.worker.get_block_ids_with_load_errors()
        return set() if self._failures_per_request else blocks

    def build_connector_worker_meta(self) -> Any:
        if (self.worker is None or not self._failures_per_request
                or not self.worker.failed_last_step):
            return None
        return FlagCXWorkerMetadata(self.worker.failed_last_step)

    if KVConnectorTransferResults is not None:
        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            sending, recving = self.get_finished(finished_req_ids)
            failed = (self.worker.failed_last_step
                      if self.worker is not None and self._failures_per_request else set())
            return transfer_results(sending or set(), recving or set(), failed)

    # ---------------------------------------------------------------- stats
    def get_kv_connector_stats(self) -> Any:
        """Counters since the previous call (vLLM aggregates them across workers)."""
        if self.worker is None:
            return None
        delta = self.worker.take_stats()
        failed = sum(self.worker.ledger.take_counts().values())
        if failed:
            delta["num_failed_transfers"] = failed
        stats = SummedConnectorStats(delta)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, object] | None = None) -> Any:
        return SummedConnectorStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: object, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return FlagCXPromMetrics(vllm_config, metric_types, labelnames,
                                 per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
