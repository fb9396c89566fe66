"""Attention cache layouts read from each attention backend's OWN contract, as vLLM's model
runner allocates them: ``get_kv_cache_shape`` gives the logical shape, and
``get_kv_cache_stride_order`` (identity where a backend does not implement it) the physical
order the raw buffer is viewed in before it is permuted back to the logical shape.

Every backend class the installed vLLM can import is read, with the connector's own reader
(``compat.attention.declared_dims``); a layout is named ``backend:<NAME>`` in the
``ATTN_LAYOUTS`` format of ``pd_caches``: (physical order over the letters 2 B N H D, the
permutation from physical to logical). Backends that declare no per-block K/V layout are
listed in ``SKIPPED``.
"""

from __future__ import annotations

import importlib
from typing import Any

BACKENDS = {
    "FLASH_ATTN": "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend",
    "FLASHINFER": "vllm.v1.attention.backends.flashinfer:FlashInferBackend",
    "TRITON_ATTN": "vllm.v1.attention.backends.triton_attn:TritonAttentionBackend",
    "FLEX_ATTENTION": "vllm.v1.attention.backends.flex_attention:FlexAttentionBackend",
    "ROCM_ATTN": "vllm.v1.attention.backends.rocm_attn:RocmAttentionBackend",
    "ROCM_AITER_FA": "vllm.v1.attention.backends.rocm_aiter_fa:AiterFlashAttentionBackend",
    "CPU_ATTN": "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend",
}
SKIPPED: dict[str, str] = {}


def _import(location: str) -> Any | None:
    module, _, name = location.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # not in this build, or needs a library this machine lacks
        return None


def _stride_order(backend: Any, rank: int) -> tuple[int, ...]:
    from vllm.config import VllmConfig

    from vllm_flagcx.compat.probe import resolve

    try:
        with resolve("set_current_vllm_config")(VllmConfig()):
            order = tuple(backend.get_kv_cache_stride_order())
    except NotImplementedError:
        return tuple(range(rank))
    return order


def contract(backend: Any) -> tuple[str, tuple[int, ...]] | None:
    """(physical letters, permutation physical -> logical) of ``backend``, or None when its
    logical shape is not one the harness reads per head (recorded in ``SKIPPED``)."""
    from vllm_flagcx.compat.attention import declared_dims

    logical = declared_dims(backend)  # what the connector itself reads
    if logical is None:
        SKIPPED[backend.__name__] = "get_kv_cache_shape declares no per-block K/V layout"
        return None
    try:
        order = _stride_order(backend, len(logical))
    except Exception as exc:  # recorded, not hidden: the test module lists SKIPPED
        SKIPPED[backend.__name__] = f"stride order: {type(exc).__name__}: {exc}"
        return None
    physical = "".join(logical[i] for i in order)
    inverse = tuple(order.index(i) for i in range(len(order)))
    return physical, inverse


def backend_layouts() -> dict[str, tuple[str, tuple[int, ...]]]:
    """``backend:<NAME>`` -> layout, for every backend this vLLM imports and the harness
    can read."""
    out = {}
    for name, location in BACKENDS.items():
        backend = _import(location)
        layout = contract(backend) if backend is not None else None
        if layout is not None:
            out[f"backend:{name}"] = layout
    return out
