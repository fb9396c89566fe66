"""Every vLLM name the connector uses, with all the places it has lived: ONE table.

Six-style: each entry lists candidate ``module:attribute`` locations in preference order.
The probe (``compat.probe``) resolves the first that imports. Adding a vLLM release that
moved something means adding a candidate here, nowhere else. ``provide`` is the line of the
vendor porting checklist (``vllm-flagcx doctor``, ``docs/porting.md``): what a vendor build
must expose for the capability.
"""

from __future__ import annotations

from dataclasses import dataclass

_KVT = "vllm.distributed.kv_transfer.kv_connector"


@dataclass(frozen=True)
class MovedName:
    key: str
    group: str
    candidates: tuple[str, ...]
    required: bool
    provide: str


MOVED_NAMES: tuple[MovedName, ...] = (
    # --- connector API -------------------------------------------------------------
    MovedName("KVConnectorBase_V1", "connector", (f"{_KVT}.v1.base:KVConnectorBase_V1",), True,
              "the V1 KV connector base class"),
    MovedName("KVConnectorRole", "connector", (f"{_KVT}.v1.base:KVConnectorRole",), True,
              "the SCHEDULER/WORKER role enum"),
    MovedName("KVConnectorMetadata", "connector", (f"{_KVT}.v1.base:KVConnectorMetadata",), True,
              "the per-step connector metadata base"),
    MovedName("SupportsHMA", "connector", (f"{_KVT}.v1.base:SupportsHMA",), True,
              "the SupportsHMA mixin (request_finished_all_groups) for hybrid models"),
    MovedName("KVConnectorHandshakeMetadata", "connector",
              (f"{_KVT}.v1.base:KVConnectorHandshakeMetadata",), True,
              "the handshake metadata base"),
    MovedName("KVConnectorWorkerMetadata", "connector",
              (f"{_KVT}.v1.base:KVConnectorWorkerMetadata",), False,
              "worker->scheduler metadata (vLLM >= 0.18); a local shim stands in"),
    MovedName("KVConnectorTransferResults", "connector",
              (f"{_KVT}.v1.base:KVConnectorTransferResults",), False,
              "request-level transfer results with failed_recving (vLLM >= 0.34)"),
    MovedName("KVConnectorFactory", "connector", (f"{_KVT}.factory:KVConnectorFactory",), True,
              "KVConnectorFactory.register_connector for the plugin entry point"),
    MovedName("KVConnectorOutput", "connector", ("vllm.v1.outputs:KVConnectorOutput",), True,
              "the KVConnectorOutput passed to update_connector_output"),
    MovedName("KVConnectorStats", "connector",
              (f"{_KVT}.v1.metrics:KVConnectorStats",), False,
              "KVConnectorStats (transfer statistics in vLLM's logging)"),
    MovedName("KVConnectorPromMetrics", "connector",
              (f"{_KVT}.v1.metrics:KVConnectorPromMetrics",), False,
              "KVConnectorPromMetrics (per-connector Prometheus metrics)"),
    MovedName("KVTransferConfig", "config", ("vllm.config:KVTransferConfig",
                                             "vllm.config.kv_transfer:KVTransferConfig"), False,
              "KVTransferConfig (its failure-policy default; read by the tests only)"),
    # --- attention -----------------------------------------------------------------
    MovedName("AttentionBackend", "attention", ("vllm.v1.attention.backend:AttentionBackend",
                                                "vllm.attention.backends.abstract:AttentionBackend"),
              False, "the AttentionBackend base class"),
    MovedName("AttentionMetadata", "attention",
              ("vllm.v1.attention.backend:AttentionMetadata",
               "vllm.attention.backends.abstract:AttentionMetadata"), False,
              "the AttentionMetadata base class"),
    MovedName("AttentionType", "attention", ("vllm.v1.attention.backend:AttentionType",
                                             "vllm.attention.backends.abstract:AttentionType"),
              False, "AttentionType (DECODER, ...)"),
    MovedName("get_attn_backend", "attention", ("vllm.v1.attention.selector:get_attn_backend",
                                                "vllm.attention.selector:get_attn_backend"), True,
              "the attention backend selector get_attn_backend"),
    MovedName("get_current_attn_backends", "attention",
              (f"{_KVT}.utils:get_current_attn_backends",), False,
              "get_current_attn_backends (>= 0.18); else single backend or a layer walk"),
    MovedName("get_current_attn_backend", "attention",
              (f"{_KVT}.utils:get_current_attn_backend",), False,
              "get_current_attn_backend (0.17); else a layer walk"),
    MovedName("get_layers_from_vllm_config", "attention",
              ("vllm.config:get_layers_from_vllm_config",
               "vllm.config.vllm:get_layers_from_vllm_config"), True,
              "get_layers_from_vllm_config for the attention layer walk"),
    MovedName("AttentionLayerBase", "attention",
              ("vllm.model_executor.layers.attention_layer_base:AttentionLayerBase",), True,
              "AttentionLayerBase (attention and Mamba layers subclass it)"),
    MovedName("get_kv_cache_layout", "attention",
              ("vllm.v1.attention.backends.utils:get_kv_cache_layout",), False,
              "get_kv_cache_layout() -> NHD/HND (<= 0.22); 0.34 resolves it on CacheConfig"),
    MovedName("NULL_BLOCK_ID", "blocks", ("vllm.v1.attention.backends.utils:NULL_BLOCK_ID",),
              False, "NULL_BLOCK_ID (>= 0.20); the fallback is 0"),
    MovedName("MambaAttentionBackendEnum", "kv_cache",
              ("vllm.v1.attention.backends.registry:MambaAttentionBackendEnum",
               "vllm.attention.backends.registry:MambaAttentionBackendEnum"), False,
              "MambaAttentionBackendEnum (names Mamba layer kinds)"),
    # --- KV cache specs ------------------------------------------------------------
    MovedName("KVCacheConfig", "kv_cache", ("vllm.v1.kv_cache_interface:KVCacheConfig",), False,
              "KVCacheConfig (num_blocks, kv_cache_tensors, kv_cache_groups)"),
    MovedName("KVCacheTensor", "kv_cache", ("vllm.v1.kv_cache_interface:KVCacheTensor",), True,
              "KVCacheTensor (size and the layers sharing it)"),
    MovedName("KVCacheGroupSpec", "kv_cache", ("vllm.v1.kv_cache_interface:KVCacheGroupSpec",),
              False, "KVCacheGroupSpec (layer_names, kv_cache_spec)"),
    MovedName("KVCacheSpec", "kv_cache", ("vllm.v1.kv_cache_interface:KVCacheSpec",), False,
              "the KVCacheSpec base"),
    MovedName("AttentionSpec", "kv_cache", ("vllm.v1.kv_cache_interface:AttentionSpec",), True,
              "AttentionSpec"),
    MovedName("FullAttentionSpec", "kv_cache", ("vllm.v1.kv_cache_interface:FullAttentionSpec",),
              False, "FullAttentionSpec"),
    MovedName("SlidingWindowSpec", "kv_cache", ("vllm.v1.kv_cache_interface:SlidingWindowSpec",),
              True, "SlidingWindowSpec"),
    MovedName("MLAAttentionSpec", "kv_cache", ("vllm.v1.kv_cache_interface:MLAAttentionSpec",),
              True, "MLAAttentionSpec"),
    MovedName("MambaSpec", "kv_cache", ("vllm.v1.kv_cache_interface:MambaSpec",), True,
              "MambaSpec (conv + ssm state in one page)"),
    # --- blocks / scheduler ----------------------------------------------------------
    MovedName("KVCacheBlocks", "blocks", ("vllm.v1.core.kv_cache_manager:KVCacheBlocks",), True,
              "KVCacheBlocks (per-group block lists)"),
    MovedName("KVCacheManager", "blocks", ("vllm.v1.core.kv_cache_manager:KVCacheManager",), False,
              "KVCacheManager"),
    MovedName("Scheduler", "blocks", ("vllm.v1.core.sched.scheduler:Scheduler",), True,
              "the v1 Scheduler"),
    MovedName("SchedulerOutput", "blocks", ("vllm.v1.core.sched.output:SchedulerOutput",), False,
              "SchedulerOutput"),
    MovedName("Request", "blocks", ("vllm.v1.request:Request",), True, "the v1 Request"),
    # --- topology (only to cross-check our own TP arithmetic) -------------------------
    MovedName("vllm_tp_topology", "topology", (f"{_KVT}.utils:TransferTopology",
                                               f"{_KVT}.utils:TpKVTopology"), False,
              "vLLM's TP topology helper (cross-check only; the connector has its own)"),
    # --- Mamba ---------------------------------------------------------------------
    MovedName("is_conv_state_dim_first", "mamba",
              ("vllm.model_executor.layers.mamba.mamba_utils:is_conv_state_dim_first",), False,
              "is_conv_state_dim_first / VLLM_SSM_CONV_STATE_LAYOUT (>= 0.17); else SD only"),
    MovedName("set_current_vllm_config", "config", ("vllm.config:set_current_vllm_config",), True,
              "set_current_vllm_config (selector and layout helpers read the current config)"),
    MovedName("get_tensor_model_parallel_rank", "config",
              ("vllm.distributed.parallel_state:get_tensor_model_parallel_rank",), True,
              "get_tensor_model_parallel_rank (the worker's TP rank)"),
    # --- platform ------------------------------------------------------------------
    MovedName("current_platform", "platform", ("vllm.platforms:current_platform",), True,
              "vllm.platforms.current_platform"),
)

MOVED_BY_KEY: dict[str, MovedName] = {m.key: m for m in MOVED_NAMES}
