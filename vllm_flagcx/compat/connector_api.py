"""The KV connector API across releases, and one base class that absorbs what moved.

Importing this module imports vLLM's connector base (vLLM has it loaded already whenever
it imports a connector), nothing heavier.

What the base absorbs:
* ``__init__`` always takes ``kv_cache_config`` and forwards it (0.22+ factory raises for a
  class without the keyword; 0.13 warns when it is None).
* ``prefer_cross_layer_blocks`` is a ClassVar on 0.13, a property on 0.14-0.22, gone on 0.34:
  a plain class attribute False works on all.
* ``handle_preemptions`` took a ``set`` of request ids (0.17/0.18) and takes the metadata from
  0.19: both are normalised to ``on_preemptions(req_ids)``.
* A ``SupportsHMA`` connector only gets ``request_finished_all_groups``; ``request_finished``
  forwards there so any caller gets the same answer.
"""

from __future__ import annotations

import abc
from collections.abc import Set as AbstractSet
from typing import Any

from vllm_flagcx.compat.probe import optional, resolve
from vllm_flagcx.wire import metrics

KVConnectorBase_V1 = resolve("KVConnectorBase_V1")
KVConnectorRole = resolve("KVConnectorRole")
KVConnectorMetadata = resolve("KVConnectorMetadata")
KVConnectorHandshakeMetadata = resolve("KVConnectorHandshakeMetadata")
SupportsHMA = resolve("SupportsHMA")
KVConnectorTransferResults = optional("KVConnectorTransferResults")


class _WorkerMetadataShim(abc.ABC):
    """Stand-in for ``KVConnectorWorkerMetadata`` on builds before 0.18 (never sent there)."""

    @abc.abstractmethod
    def aggregate(self, other: _WorkerMetadataShim) -> _WorkerMetadataShim: ...


KVConnectorWorkerMetadata = optional("KVConnectorWorkerMetadata") or _WorkerMetadataShim


def _base_takes_kv_cache_config() -> bool:
    from vllm_flagcx.compat.capabilities import capabilities

    return capabilities().connector_kv_cache_config_arg != "absent"


class PortableConnectorBase(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc, valid-type]
    """Base of FlagCXConnector: one class body that every supported vLLM accepts."""

    prefer_cross_layer_blocks = False

    def __init__(self, vllm_config: Any, role: object, kv_cache_config: object = None) -> None:
        refuse_sleep_mode(vllm_config)
        if _base_takes_kv_cache_config():
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        else:
            super().__init__(vllm_config=vllm_config, role=role)
            self._kv_cache_config = kv_cache_config

    @property
    def kv_cache_config(self) -> Any:
        return getattr(self, "_kv_cache_config", None)

    # -- vLLM 0.34's hooks (docs/vllm-hooks.md: the audit, a test per row) ---------------
    @classmethod
    def kv_cache_access(cls, kv_transfer_config: object) -> int | None:
        """REGISTERS | LEGACY_IPC: FlagCX registers the device KV cache with its RDMA
        engine (one physical allocation per segment), and the same-host transport shares
        it through ``cuIpcGetMemHandle``, which cannot export the driver-mapped
        "extensible" KV cache 0.34 allocates by default; vLLM then allocates it the
        classic way. The default (IN_PROCESS) would fail the first registration on GPU."""
        return registered_and_ipc_shared()

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: object) -> bool:
        """No (``refuse_sleep_mode`` says why)."""
        return False

    def get_loaded_kv_cache_group_ids(self, request: object) -> tuple[int, ...]:
        """Every transfer group: a load writes the request's own blocks in all of them
        (not a hash-addressed store). vLLM zeroes the blocks of the groups NOT named when
        it allocates them; its default names only the prefix-cacheable ones."""
        config = self.kv_cache_config
        ids = getattr(config, "transfer_group_ids", None)
        return tuple(ids) if ids is not None else tuple(range(len(config.kv_cache_groups)))

    # -- preemptions: set[str] (0.17/0.18) or metadata (0.19+) -------------------------
    def handle_preemptions(self, preempted: object) -> None:
        if isinstance(preempted, (set, frozenset, list, tuple)):
            req_ids = set(preempted)
        else:
            req_ids = set(getattr(preempted, "preempted_req_ids", None) or ())
        self.on_preemptions(req_ids)

    def on_preemptions(self, req_ids: set[str]) -> None:
        """Preempted requests, whatever form the installed vLLM reported them in."""

    # -- finish path ---------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self.request_finished_all_groups(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, object] | None]:
        raise NotImplementedError


def registered_and_ipc_shared() -> int | None:
    """``KVCacheAccess.REGISTERS | LEGACY_IPC`` of this vLLM (0.34+: the flag type lives
    beside ``KVTransferConfig``), or None where the build has no such flags."""
    import sys

    config_cls = optional("KVTransferConfig")
    module = sys.modules.get(getattr(config_cls, "__module__", ""), None)
    flags = getattr(module, "KVCacheAccess", None)
    return None if flags is None else flags.REGISTERS | flags.LEGACY_IPC  # an IntFlag


def refuse_sleep_mode(vllm_config: object) -> None:
    """Sleep mode frees the KV cache and maps it again at other addresses, while the
    transports keep the addresses registered at start (CUDA IPC handles, RDMA
    registrations, the peer's cached mappings): a transfer would then write memory
    nobody registered. 0.34 asks the connector (``supports_sleep_mode``); older builds
    do not, so the connector refuses it itself, the same on every build."""
    if getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False):
        raise ValueError(
            "FlagCXConnector does not support sleep mode (model_config.enable_sleep_mode="
            "True): sleep mode moves the KV cache that the transports registered at start. "
            "Start vLLM without --enable-sleep-mode, or use another connector for it.")


def step_computes_nothing(scheduler_output: object) -> bool:
    """The step schedules no token (``SchedulerOutput.total_num_scheduled_tokens == 0``,
    a field of every supported build): its workers run only the connector's hooks. A
    build without the field reads as "computes", so nothing ever waits there."""
    scheduled = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    return isinstance(scheduled, int) and scheduled == 0


def role_is_scheduler(role: object) -> bool:
    return role == KVConnectorRole.SCHEDULER


def transfer_results(finished_sending: AbstractSet[str], finished_recving: AbstractSet[str],
                     failed_recving: AbstractSet[str]) -> Any:
    """A ``KVConnectorTransferResults`` (0.34), with failed receives reported per request."""
    cls = KVConnectorTransferResults
    return cls(finished_sending=set(finished_sending), finished_recving=set(finished_recving),
               failed_recving=set(failed_recving))


_StatsBase = optional("KVConnectorStats") or object


class SummedConnectorStats(_StatsBase):  # type: ignore[misc, valid-type]
    """vLLM ``KVConnectorStats`` over one report of ``wire.metrics``: counters that add up
    across workers and intervals, per-request samples for the histograms, and gauges
    (the catalog says which key is which)."""

    def __init__(self, data: dict[str, object] | None = None) -> None:
        self.data = dict(data or {})

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: object) -> SummedConnectorStats:
        metrics.merge(self.data, dict(getattr(other, "data", None) or {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        """What vLLM's periodic log line shows: counters, each histogram's count and mean,
        gauges as they are."""
        out: dict[str, int | float] = {}
        for key, value in self.data.items():
            if isinstance(value, list):
                out[f"{key}_count"] = len(value)
                if value:
                    out[f"{key}_avg"] = round(sum(value) / len(value), 6)
            elif isinstance(value, (int, float)):
                out[key] = value
        seconds, total = out.get("send_seconds", 0.0), out.get("send_bytes", 0)
        if seconds:
            out["send_GBps"] = round(total / seconds / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return metrics.is_empty(self.data)

    def to_dict(self) -> dict[str, object]:
        return self.data


_PromBase = optional("KVConnectorPromMetrics") or object


class FlagCXPromMetrics(_PromBase):  # type: ignore[misc, valid-type]
    """One Prometheus family per ``wire.metrics.FAMILIES`` entry, a child per engine
    (vLLM's ``KVConnectorPromMetrics`` contract)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        import prometheus_client

        self.families: dict[str, dict[int, Any]] = {}
        for family in metrics.FAMILIES:
            if family.kind is metrics.Kind.COUNTER:
                parent = metric_types[prometheus_client.Counter](
                    name=family.name, documentation=family.help, labelnames=labelnames)
            elif family.kind is metrics.Kind.HISTOGRAM:
                parent = metric_types[prometheus_client.Histogram](
                    name=family.name, documentation=family.help, labelnames=labelnames,
                    buckets=list(family.buckets))
            else:
                parent = metric_types[prometheus_client.Gauge](
                    name=family.name, documentation=family.help, labelnames=labelnames,
                    multiprocess_mode="mostrecent")
            self.families[family.key] = {engine: parent.labels(*values)
                                         for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, object], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            family, child = metrics.BY_KEY.get(key), self.families.get(key, {}).get(engine_idx)
            if family is None or child is None:
                continue
            if family.kind is metrics.Kind.HISTOGRAM:
                for sample in value if isinstance(value, list) else ():
                    child.observe(sample)
            elif family.kind is metrics.Kind.GAUGE:
                child.set(value)
            elif value:
                child.inc(value)
