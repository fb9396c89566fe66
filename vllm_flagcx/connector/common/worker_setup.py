"""What the worker half is built from, read off vLLM once when the KV caches are
registered: the memory regions of every layer, the layout facts a peer must match, and
the attention kernel's storage format.

Why a module of its own: the entry class only dispatches vLLM's hooks; deriving regions
and facts is the worker's one-time setup, written against ``compat`` like the rest.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_flagcx.compat import config as compat_config
from vllm_flagcx.compat import kv_cache as compat_kv
from vllm_flagcx.compat.kv_cache import GroupFacts, SpecKind
from vllm_flagcx.compat.kv_views import LayerView
from vllm_flagcx.compat.vllm_types import KVCacheConfigLike
from vllm_flagcx.layout.regions import Region
from vllm_flagcx.wire import handshake as hs

logger = logging.getLogger("vllm_flagcx")


def attention_dims(vllm_config: Any, kv_cache_config: KVCacheConfigLike) -> dict[int, str | None]:
    """Per attention group, the dimensions its backend declares
    (``compat.attention.layer_attention_dims``)."""
    from vllm_flagcx.compat.attention import layer_attention_dims

    return {i: layer_attention_dims(vllm_config, list(g.layer_names))
            for i, g in compat_kv.attention_groups(kv_cache_config)}


def kv_cache_regions(vllm_config: Any, kv_cache_config: KVCacheConfigLike, tp_size: int,
                     kv_caches: dict[str, Any], dims: dict[int, str | None]) -> list[Region]:
    """Regions of every registered cache tensor, each attention group's K/V taken from
    the dimensions its backend declares (``dims``, from ``attention_dims``)."""
    from vllm_flagcx.compat import kv_layout

    model = vllm_config.model_config
    return kv_layout.regions_for_kv_caches(
        kv_caches, kv_cache_config, tp_size, model.get_total_num_kv_heads(),
        compat_kv.conv_state_layout(),
        compat_config.gdn_conv_split(model.hf_config, tp_size), dims)


def kv_cache_views(vllm_config: Any, kv_cache_config: KVCacheConfigLike, kv_caches: dict[str, Any],
                   dims: dict[int, str | None], regions: list[Region], tp_size: int
                   ) -> dict[str, LayerView]:
    """Each layer as vLLM indexes it (attention and Mamba/GDN state), for the full
    logical digest (``compat.kv_views``)."""
    from vllm_flagcx.compat.kv_views import cache_views
    from vllm_flagcx.layout.regions import kernel_ratios

    model = vllm_config.model_config
    ratios = kernel_ratios(regions, len(kv_cache_config.kv_cache_groups),
                           kv_cache_config.num_blocks)
    split = compat_config.gdn_conv_split(model.hf_config, tp_size)
    return cache_views(kv_caches, kv_cache_config, model.get_total_num_kv_heads(), dims,
                       ratios, compat_config.tp_rank(), tp_size,
                       compat_kv.conv_state_layout(), split.parts if split else None)


def attention_cache_format(vllm_config: Any, kv_cache_config: KVCacheConfigLike,
                           groups: list[GroupFacts]) -> str:
    """``compat.attention.cache_format`` of the attention layers ("none" without)."""
    from vllm_flagcx.compat.attention import cache_format

    attention = [g for g in groups if g.kind is not SpecKind.MAMBA]
    if not attention:
        return "none"
    spec = kv_cache_config.kv_cache_groups[attention[0].index].kv_cache_spec
    return cache_format(vllm_config, [n for g in attention for n in g.layer_names],
                        int(vllm_config.cache_config.block_size),
                        int(getattr(spec, "head_size", 0)))


def layout_facts(vllm_config: Any, kv_cache_config: KVCacheConfigLike, regions: list[Region]
                 ) -> hs.LayoutFacts:
    """The ``wire.handshake.LayoutFacts`` a peer's must match before any byte moves."""
    from vllm_flagcx.layout.regions import kernel_ratios, model_page_bytes

    model = vllm_config.model_config
    groups = compat_kv.group_facts(kv_cache_config)
    ratios = kernel_ratios(regions, len(groups), kv_cache_config.num_blocks)
    return hs.LayoutFacts(
        model=str(model.model), dtype=str(model.dtype).removeprefix("torch."),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        group_kinds=tuple(g.kind.value for g in groups),
        block_sizes=tuple(g.block_size for g in groups),
        kernel_block_sizes=tuple(g.block_size // r for g, r in zip(groups, ratios,
                                                                    strict=True)),
        page_bytes=model_page_bytes(regions, len(groups)),
        conv_layout=compat_kv.conv_state_layout(),
        num_kv_heads=int(model.get_total_num_kv_heads()),
        cache_format=attention_cache_format(vllm_config, kv_cache_config, groups))


def warn_on_cpu_binding(host_memory: bool) -> None:
    """Log the operator hint when vLLM's automatic OpenMP binding pinned this CPU worker
    to a core another engine on the host may share (``connector.host_cpus`` says why)."""
    if not hasattr(os, "sched_getaffinity"):
        return
    from vllm_flagcx.connector.common.host_cpus import allowed_cpus, cpu_binding_warning

    hint = cpu_binding_warning(set(os.sched_getaffinity(0)), allowed_cpus(),
                               compat_config.env("VLLM_CPU_OMP_THREADS_BIND"), host_memory)
    if hint:
        logger.warning("FlagCXConnector: %s", hint)


def start_line(*, role: str, tp_rank: int, transport: str, advertised_host: str,
               bind_host: str, port: int, host_memory: bool, secret: bool) -> str:
    """The one line a worker logs when it starts: what it chose and where it listens,
    so an operator reads the transport ``auto`` picked and the side channel's address
    off the engine log instead of guessing (``vllm-flagcx doctor`` says the same before
    start). On host memory it names the vLLM CPU kernel library this process loaded
    (``compat.cpu_kernels``): a peer on another library may store other bytes."""
    from vllm_flagcx.compat import cpu_kernels
    from vllm_flagcx.wire import endpoints

    tcp = f"TCP {bind_host}:{port} (advertised as {advertised_host}:{port}) and " if secret \
        else ""
    where = (f"side channel on {tcp}{endpoints.socket_path(port)}" if role == "prefill"
             else "pulls from the prefill side channels it is given")
    auth = ("secret set: peers of any user and host that hold it (CURVE); a same-host "
            "pull must come over the Unix socket from the process it names" if secret else
            f"no secret: no TCP port, only processes of uid {os.getuid()} (the socket's "
            "directory is 0700)")
    line = (f"FlagCXConnector {role} worker rank {tp_rank}: transport {transport}, {where}, "
            f"{auth}")
    if host_memory:
        library = cpu_kernels.loaded_library()
        klass = cpu_kernels.process_class()
        hidden = cpu_kernels.hidden_features()
        line += (f", CPU kernel library {library or 'unknown'} (class {klass or 'unknown'}"
                 + (f"; hidden from vLLM: {', '.join(hidden)}" if hidden else "") + ")")
    return line
