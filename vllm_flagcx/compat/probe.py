"""Feature probes over the installed vLLM: resolve moved names, detect changed behaviour.

Two kinds of capability, one report:

* **names** (``compat.moved.MOVED_NAMES``): the first candidate location that imports;
* **features**: a signature, a dataclass field, a default, an attribute kind. Each probe
  returns a short label ("set" / "metadata", "shared_by" / "layers", ...). Version numbers
  are used only where behaviour has no probe-able trace, and such probes say so.

Everything is cached: vLLM's modules are imported once, on first use, never at import time
of this module (the connector module must stay cheap to import).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_flagcx.compat import version
from vllm_flagcx.compat.moved import MOVED_BY_KEY, MOVED_NAMES, MovedName

ABSENT = "absent"


class MissingCapability(ImportError):
    """A capability the connector needs is not in the installed vLLM build."""

    def __init__(self, key: str, tried: tuple[str, ...], provide: str) -> None:
        self.key = key
        self.tried = tried
        self.provide = provide
        super().__init__(
            f"vLLM capability {key!r} is MISSING: tried {', '.join(tried)}. "
            f"A vendor build must provide {provide}. Run `vllm-flagcx doctor` for the full list."
        )


def _import_attr(location: str) -> Any:
    module_name, _, attr = location.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr)


@functools.cache
def locate(key: str) -> tuple[str | None, Any]:
    """(location, object) of a moved name, or (None, None) where no candidate imports."""
    entry = MOVED_BY_KEY[key]
    for location in entry.candidates:
        try:
            return location, _import_attr(location)
        except (ImportError, AttributeError):
            continue
    return None, None


def resolve(key: str) -> Any:
    """The object behind a moved name; raises ``MissingCapability`` naming what is missing."""
    location, obj = locate(key)
    if location is None:
        entry = MOVED_BY_KEY[key]
        raise MissingCapability(key, entry.candidates, entry.provide)
    return obj


def optional(key: str) -> Any:
    """The object behind an optional moved name, or None (typed ``Any``: vLLM's own
    objects, unknown to the type checker here)."""
    return locate(key)[1]


# ----------------------------------------------------------------------------- features


def _field_names(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(cls, "__annotations__", {}))


def _field_default(cls: type, name: str) -> Any:
    for field in dataclasses.fields(cls):
        if field.name == name:
            if field.default is not dataclasses.MISSING:
                return getattr(field.default, "default", field.default)
            return None
    return None


def _kv_cache_config_ctor() -> str:
    init = inspect.signature(resolve("KVConnectorBase_V1").__init__)
    param = init.parameters.get("kv_cache_config")
    if param is None:
        return ABSENT
    return "required" if param.default is inspect.Parameter.empty else "optional"


def _handle_preemptions() -> str:
    method = getattr(resolve("KVConnectorBase_V1"), "handle_preemptions", None)
    if method is None:
        return ABSENT
    params = list(inspect.signature(method).parameters)
    return "set" if "preempted_req_ids" in params else "metadata"


def _prefer_cross_layer_blocks() -> str:
    try:
        static = inspect.getattr_static(resolve("KVConnectorBase_V1"), "prefer_cross_layer_blocks")
    except AttributeError:
        return ABSENT
    return "property" if isinstance(static, property) else "classvar"


def _attn_backend_block_size() -> str:
    params = inspect.signature(resolve("get_attn_backend")).parameters
    return "parameter" if "block_size" in params else ABSENT


def _current_attn_backends() -> str:
    if optional("get_current_attn_backends") is not None:
        return "list"
    if optional("get_current_attn_backend") is not None:
        return "single"
    return "layer_walk"


def _kv_layout_source() -> str:
    if optional("get_kv_cache_layout") is not None:
        return "get_kv_cache_layout"
    cache_config = importlib.import_module("vllm.config").CacheConfig
    if hasattr(cache_config, "get_resolved_kv_cache_layout"):
        return "resolved_layout"
    return ABSENT


def _kv_cache_tensor_layers() -> str:
    fields = _field_names(resolve("KVCacheTensor"))
    if "shared_by" in fields:
        return "shared_by"
    return "layers" if "layers" in fields else ABSENT


def _mamba_type() -> str:
    default = _field_default(resolve("MambaSpec"), "mamba_type")
    if isinstance(default, str) and type(default) is str:
        return "str"
    return "enum" if optional("MambaAttentionBackendEnum") is not None else ABSENT


def _unhashed_all_groups() -> str:
    blocks = resolve("KVCacheBlocks")
    return "native" if hasattr(blocks, "get_unhashed_block_ids_all_groups") else "computed"


def _block_ids_group_ids() -> str:
    params = inspect.signature(resolve("KVCacheBlocks").get_block_ids).parameters
    return "kwarg" if "group_ids" in params else ABSENT


def _hma_default() -> str:
    # Behaviour without a probe-able trace: in 0.22 VllmConfig started importing the
    # connector class to keep HMA on for SupportsHMA connectors. A test builds a real
    # VllmConfig in every env and checks this label against the resolved flag. A version
    # string that does not parse (a vendor dev build) is decided by that trace in
    # VllmConfig's source instead of being read as 0.0.0.
    installed = version.installed_version()
    if installed.unreadable:
        source = inspect.getsource(importlib.import_module("vllm.config").VllmConfig)
        return "auto" if "supports_hma" in source else "off_with_connector"
    return "auto" if installed.at_least("0.22") else "off_with_connector"


def _conv_layouts() -> str:
    return "SD,DS" if optional("is_conv_state_dim_first") is not None else "SD"


def _truncate_block_hashes() -> str:
    return "native" if hasattr(resolve("Request"), "truncate_block_hashes") else ABSENT


def _resumed_requests() -> str:
    output = importlib.import_module("vllm.v1.core.sched.output")
    cached = getattr(output, "CachedRequestData", None)
    if cached is not None and "resumed_req_ids" in _field_names(cached):
        return "resumed_req_ids"
    return "scheduled_new_reqs"


def _dp_index_field() -> str:
    fields = _field_names(importlib.import_module("vllm.config").ParallelConfig)
    return "data_parallel_index" if "data_parallel_index" in fields else "data_parallel_rank"


def _failure_policy_default() -> str:
    fields = _field_names(resolve("KVTransferConfig"))
    if "kv_load_failure_policy" not in fields:
        return ABSENT
    return str(_field_default(resolve("KVTransferConfig"), "kv_load_failure_policy"))


def _legacy_kv_fields() -> str:
    fields = _field_names(resolve("KVTransferConfig"))
    return "accepted" if "kv_ip" in fields else "forbidden"


def _hybrid_async_load() -> str:
    # 0.13's scheduler unpacks ONE group when an async load completes
    # ("(block_ids,) = ...get_block_ids"), so hybrid (multi-group) remote loads crash there.
    # Read from the installed scheduler's source: no other trace of this behaviour exists.
    method = getattr(resolve("Scheduler"), "_update_waiting_for_remote_kv", None)
    if method is None:
        return ABSENT
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):
        return "multi_group"
    return "single_group" if "(block_ids,) =" in source else "multi_group"


def _scheduler_source(method_name: str) -> str | None:
    """Source of a Scheduler method; None where the method is absent or has no source."""
    method = getattr(resolve("Scheduler"), method_name, None)
    if method is None:
        return None
    try:
        return inspect.getsource(method)
    except (OSError, TypeError):
        return None


def _failed_load_blocks() -> str:
    """Does ``_update_waiting_for_remote_kv`` free the blocks of a request listed in
    ``failed_recving_kv_req_ids``? (read from its source: no other trace exists)."""
    source = _scheduler_source("_update_waiting_for_remote_kv") or ""
    if "failed_recving_kv_req_ids" in source and "kv_cache_manager.free(" in source:
        return "freed"
    return ABSENT


def _finished_load_blocks() -> str:
    """Does ``_update_from_kv_xfer_finished`` free the blocks of a request that FINISHED
    (aborted, or failed by ``kv_load_failure_policy=fail``) while its load was in flight,
    when ``finished_recving`` names it? 0.20+ do; 0.13 only records the id, and blocks
    a connector kept (``request_finished`` -> True) would never come back."""
    source = _scheduler_source("_update_from_kv_xfer_finished") or ""
    loop = "in kv_connector_output.finished_recving"
    if loop not in source:
        return ABSENT
    recving = source.split(loop, 1)[1].split("finished_sending", 1)[0]
    if "is_finished" in recving and "_free_blocks(" in recving:
        return "freed"
    return ABSENT


def _mamba_align_external_tokens() -> str:
    """0.22's ``_mamba_block_aligned_split`` asserts that no external tokens arrive in
    mamba_cache_mode='align' ("External KV connector is not verified yet"); 0.34 dropped it."""
    source = _scheduler_source("_mamba_block_aligned_split")
    if source is None:
        return ABSENT
    return "asserts_none" if "num_external_computed_tokens == 0" in source else "accepted"


def _load_failure_report() -> str:
    """How a failed receive of a multi-group (HMA) request can reach the scheduler.

    Block-level ``invalid_block_ids`` only map to requests with ONE KV cache group on every
    build (0.13-0.22 unpack one group, 0.34 raises), so hybrids need a request-level path.
    """
    output_fields = _field_names(resolve("KVConnectorOutput"))
    if "failed_recving" in output_fields:
        return "failed_recving"
    if "kv_connector_worker_meta" in output_fields:
        return "worker_meta"
    return ABSENT


def _handshake_pp_aware() -> str:
    base = resolve("KVConnectorBase_V1")
    return "native" if hasattr(base, "set_xfer_handshake_metadata_pp_aware") else ABSENT


def _new_request_hook() -> str:
    """Does the scheduler tell the connector when a request enters the engine (0.22+)?"""
    base = resolve("KVConnectorBase_V1")
    return "native" if hasattr(base, "on_new_request") else ABSENT


@dataclass(frozen=True)
class FeatureProbe:
    key: str
    group: str
    probe: Callable[[], str]
    required: bool
    provide: str


FEATURES: tuple[FeatureProbe, ...] = (
    FeatureProbe("connector_kv_cache_config_arg", "connector", _kv_cache_config_ctor, True,
                 "KVConnectorBase_V1.__init__(vllm_config, role, kv_cache_config)"),
    FeatureProbe("handle_preemptions", "connector", _handle_preemptions, False,
                 "handle_preemptions(set) (0.17/0.18) or (metadata) (0.19+)"),
    FeatureProbe("prefer_cross_layer_blocks", "connector", _prefer_cross_layer_blocks, False,
                 "prefer_cross_layer_blocks (class attribute or property; gone in 0.34)"),
    FeatureProbe("handshake_pp_aware", "connector", _handshake_pp_aware, False,
                 "set_xfer_handshake_metadata_pp_aware (0.34)"),
    FeatureProbe("new_request_hook", "connector", _new_request_hook, False,
                 "on_new_request(request) (0.22+; decode's first heartbeat is sent at "
                 "arrival, else at first scheduling)"),
    FeatureProbe("attn_backend_block_size", "attention", _attn_backend_block_size, False,
                 "get_attn_backend(block_size=...) (dropped in 0.18)"),
    FeatureProbe("current_attn_backends", "attention", _current_attn_backends, True,
                 "a way to list the attention backends in use"),
    FeatureProbe("kv_layout", "attention", _kv_layout_source, True,
                 "get_kv_cache_layout() or CacheConfig.get_resolved_kv_cache_layout()"),
    FeatureProbe("kv_cache_tensor_layers", "kv_cache", _kv_cache_tensor_layers, True,
                 "KVCacheTensor.shared_by (<= 0.22) or .layers (0.34)"),
    FeatureProbe("mamba_type", "kv_cache", _mamba_type, False,
                 "MambaSpec.mamba_type as str (<= 0.20) or MambaAttentionBackendEnum (0.22+)"),
    FeatureProbe("unhashed_block_ids_all_groups", "blocks", _unhashed_all_groups, True,
                 "KVCacheBlocks (get_unhashed_block_ids_all_groups is computed where absent)"),
    FeatureProbe("block_ids_group_ids", "blocks", _block_ids_group_ids, False,
                 "KVCacheBlocks.get_block_ids(group_ids=...) (0.34)"),
    FeatureProbe("hma_default", "blocks", _hma_default, True,
                 "SchedulerConfig.disable_hybrid_kv_cache_manager (version-gated default)"),
    FeatureProbe("conv_state_layouts", "mamba", _conv_layouts, True,
                 "the Mamba conv state layouts the build can produce"),
    FeatureProbe("truncate_block_hashes", "mamba", _truncate_block_hashes, False,
                 "Request.truncate_block_hashes (0.34; needed for the N-1 rule there)"),
    FeatureProbe("hybrid_async_load", "blocks", _hybrid_async_load, True,
                 "a scheduler that completes async KV loads of multi-group (hybrid) requests"),
    FeatureProbe("hybrid_load_failure_report", "blocks", _load_failure_report, False,
                 "KVConnectorOutput.failed_recving (0.34) or kv_connector_worker_meta (0.18+)"
                 " to fail one hybrid request"),
    FeatureProbe("failed_load_blocks", "blocks", _failed_load_blocks, False,
                 "a scheduler that frees the blocks of a request in failed_recving_kv_req_ids"
                 " (the recompute path of hybrid requests before 0.34)"),
    FeatureProbe("finished_load_blocks", "blocks", _finished_load_blocks, False,
                 "a scheduler that frees a finished request's blocks when finished_recving"
                 " names it (else the connector reports it sent: compat.vllm_writes)"),
    FeatureProbe("mamba_align_external_tokens", "mamba", _mamba_align_external_tokens, False,
                 "Scheduler._mamba_block_aligned_split accepting external (remote) tokens"
                 " (prefix caching on a hybrid decode)"),
    FeatureProbe("resumed_requests", "blocks", _resumed_requests, False,
                 "CachedRequestData.resumed_req_ids or resumed requests in scheduled_new_reqs"),
    FeatureProbe("dp_index_field", "config", _dp_index_field, True,
                 "ParallelConfig.data_parallel_index (0.17+) or data_parallel_rank"),
    FeatureProbe("kv_load_failure_policy_default", "config", _failure_policy_default, False,
                 "KVTransferConfig.kv_load_failure_policy"),
    FeatureProbe("legacy_kv_fields", "config", _legacy_kv_fields, False,
                 "KVTransferConfig kv_ip/kv_rank/... (forbidden from 0.34)"),
)

FEATURES_BY_KEY: dict[str, FeatureProbe] = {f.key: f for f in FEATURES}


@dataclass(frozen=True)
class CapabilityReport:
    key: str
    group: str
    kind: str  # "name" or "feature"
    required: bool
    found: bool
    where: str  # location, probe label, or the error that made the probe fail
    provide: str


def _report_name(entry: MovedName) -> CapabilityReport:
    location, _ = locate(entry.key)
    return CapabilityReport(entry.key, entry.group, "name", entry.required,
                            location is not None, location or ABSENT, entry.provide)


def _report_feature(entry: FeatureProbe) -> CapabilityReport:
    try:
        label = entry.probe()
    except Exception as exc:  # a probe that crashes is a missing capability, not a crash
        return CapabilityReport(entry.key, entry.group, "feature", entry.required, False,
                                f"probe failed: {type(exc).__name__}: {exc}", entry.provide)
    return CapabilityReport(entry.key, entry.group, "feature", entry.required,
                            label != ABSENT, label, entry.provide)


def capability_reports() -> list[CapabilityReport]:
    """One report per capability, names first, in table order."""
    return [_report_name(m) for m in MOVED_NAMES] + [_report_feature(f) for f in FEATURES]


def profile() -> dict[str, str]:
    """key -> where/label; what matrix/builds.toml states per build."""
    return {r.key: r.where for r in capability_reports()}


def installed_platform_traits() -> version.PlatformTraits:
    """``version.platform_traits`` of the running vLLM's ``current_platform``."""
    return version.platform_traits(resolve("current_platform"))
