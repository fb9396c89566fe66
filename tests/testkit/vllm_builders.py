"""Real vLLM KV cache specs and configs, built the same way on every matrix build.

Test-only (the connector reads specs, it never builds one), so it lives in the test kit,
not in ``compat``. What differs by build is read from ``compat``: ``MambaSpec.mamba_type``
as a str (<= 0.20) or ``MambaAttentionBackendEnum`` (0.22+), ``KVCacheTensor.shared_by``
(<= 0.22) or ``layers`` plus strides (0.34), keyword-only ``AttentionSpec`` (0.17+).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_flagcx.compat.capabilities import capabilities
from vllm_flagcx.compat.kv_cache import MAMBA_NAME_TO_ENUM
from vllm_flagcx.compat.probe import resolve


def _mamba_type_value(name: str) -> Any:
    """The value ``MambaSpec(mamba_type=...)`` expects on this build, from a canonical name."""
    if capabilities().mamba_type == "str":
        return name
    enum_cls = resolve("MambaAttentionBackendEnum")
    try:
        return enum_cls[MAMBA_NAME_TO_ENUM[name]]
    except KeyError as exc:
        raise ValueError(
            f"mamba_type={name!r} is unknown; expected one of {sorted(MAMBA_NAME_TO_ENUM)}"
        ) from exc


def make_full_attention_spec(*, block_size: int, num_kv_heads: int, head_size: int,
                             dtype: Any, sliding_window: int | None = None) -> Any:
    """A ``FullAttentionSpec`` (or ``SlidingWindowSpec`` when ``sliding_window`` is set)."""
    common = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                  dtype=dtype)
    if sliding_window is not None:
        return resolve("SlidingWindowSpec")(sliding_window=sliding_window, **common)
    return resolve("FullAttentionSpec")(**common)


def make_mla_spec(*, block_size: int, head_size: int, dtype: Any,
                  cache_dtype_str: str = "auto") -> Any:
    return resolve("MLAAttentionSpec")(block_size=block_size, num_kv_heads=1,
                                       head_size=head_size, dtype=dtype,
                                       cache_dtype_str=cache_dtype_str)


def make_mamba_spec(*, block_size: int, shapes: Sequence[Sequence[int]], dtypes: Sequence[Any],
                    mamba_type: str = "gdn_attention", page_size_padded: int | None = None) -> Any:
    return resolve("MambaSpec")(
        block_size=block_size,
        shapes=tuple(tuple(s) for s in shapes),
        dtypes=tuple(dtypes),
        mamba_type=_mamba_type_value(mamba_type),
        page_size_padded=page_size_padded,
    )


def make_kv_cache_tensor(*, size: int, layer_names: Sequence[str], num_blocks: int) -> Any:
    """A ``KVCacheTensor`` of ``size`` bytes shared by ``layer_names``.

    On 0.34 a tensor also states its strides; a tensor shared by layers in one group
    (``shared_by``-style sharing) has layer stride 0 and a block stride of one page.
    """
    cls = resolve("KVCacheTensor")
    if capabilities().kv_cache_tensor_layers == "shared_by":
        return cls(size=size, shared_by=list(layer_names))
    return cls(size=size, layers=list(layer_names), layer_stride=0,
               block_stride=size // num_blocks)


def make_kv_cache_config(*, num_blocks: int, groups: Sequence[tuple[Sequence[str], Any]],
                         tensors: Sequence[tuple[int, Sequence[str]]]) -> Any:
    """A real ``KVCacheConfig`` from (layer names, spec) groups and (size, layers) tensors."""
    group_cls = resolve("KVCacheGroupSpec")
    return resolve("KVCacheConfig")(
        num_blocks=num_blocks,
        kv_cache_tensors=[make_kv_cache_tensor(size=s, layer_names=n, num_blocks=num_blocks)
                          for s, n in tensors],
        kv_cache_groups=[group_cls(layer_names=list(n), kv_cache_spec=spec) for n, spec in groups],
    )
