"""Attention cache layouts read from each attention backend's OWN contract, as vLLM's model
runner allocates them: ``get_kv_cache_shape`` gives the logical shape, and
``get_kv_cache_stride_order`` (identity where a backend does not implement it) the physical
order the raw buffer is viewed in before it is permuted back to the logical shape.

Every backend class the installed vLLM can import is read; a layout is named
``backend:<NAME>`` in the ``ATTN_LAYOUTS`` format of ``pd_caches``: (physical order over the
letters 2 B N H D, the permutation from physical to logical). Backends whose logical shape
is not one of the two families the harness reads per head ((2, B, N, H, D) or
(B, 2, N, H, D)) are listed in ``SKIPPED`` with their shape (the CPU backend's
(2, B, H, N, D) runs in the real CPU engines of ``tests/e2e`` instead).
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
# Distinct sizes so a shape names its dimensions: blocks, tokens per block, heads, head dim.
_PROBE = {"B": 1009, "N": 32, "H": 3, "D": 64}  # N: FLASH_ATTN wants a multiple of 16
READABLE = ("2BNHD", "B2NHD")
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
    letters = {2: "2", **{v: k for k, v in _PROBE.items()}}
    try:
        shape = backend.get_kv_cache_shape(_PROBE["B"], _PROBE["N"], _PROBE["H"],
                                           _PROBE["D"])
    except Exception as exc:
        SKIPPED[backend.__name__] = f"get_kv_cache_shape: {type(exc).__name__}: {exc}"
        return None
    logical = "".join(letters.get(int(n), "?") for n in shape)  # "?": a packed dimension
    if logical not in READABLE:
        SKIPPED[backend.__name__] = f"logical shape {logical}"
        return None
    try:
        order = _stride_order(backend, len(shape))
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
