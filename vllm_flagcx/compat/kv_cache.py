"""KV cache specs and configs, normalised across vLLM releases.

What moved: ``AttentionSpec`` became keyword-only (0.17), ``MambaSpec.mamba_type`` went from
a str (<= 0.20) to ``MambaAttentionBackendEnum`` (0.22), ``KVCacheTensor.shared_by`` became
``layers`` plus strides (0.34), and hybrid models raise the attention block size, so a
group's block size is read from the ``KVCacheConfig``, never from ``--block-size``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_flagcx.compat.capabilities import capabilities
from vllm_flagcx.compat.probe import resolve


class SpecKind(str, enum.Enum):
    """The layer kinds a transfer plan distinguishes."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla"
    MAMBA = "mamba"


# Canonical Mamba layer names: the 0.20 strings; 0.22's enum members map onto them.
_MAMBA_ENUM_TO_NAME = {
    "MAMBA1": "mamba1",
    "MAMBA2": "mamba2",
    "SHORT_CONV": "short_conv",
    "LINEAR": "linear_attention",
    "GDN_ATTN": "gdn_attention",
    "CUSTOM": "custom",
}
_MAMBA_NAME_TO_ENUM = {v: k for k, v in _MAMBA_ENUM_TO_NAME.items()}


def spec_kind(spec: Any) -> SpecKind:
    """Classify a real vLLM KV cache spec (subclasses first: MLA is a FullAttentionSpec)."""
    if isinstance(spec, resolve("MambaSpec")):
        return SpecKind.MAMBA
    if isinstance(spec, resolve("MLAAttentionSpec")):
        return SpecKind.MLA
    if isinstance(spec, resolve("SlidingWindowSpec")):
        return SpecKind.SLIDING_WINDOW
    if isinstance(spec, resolve("AttentionSpec")):
        return SpecKind.FULL_ATTENTION
    raise TypeError(
        f"unsupported KV cache spec {type(spec).__name__}: FlagCXConnector moves full, "
        "sliding-window, MLA and Mamba/GDN layers"
    )


def mamba_type_name(spec_or_value: Any) -> str:
    """``mamba_type`` as a lowercase name ("gdn_attention"), whichever form vLLM uses."""
    value = getattr(spec_or_value, "mamba_type", spec_or_value)
    if isinstance(value, str) and not isinstance(value, enum.Enum):
        return value.lower()
    name = getattr(value, "name", None)
    if name is None:
        raise TypeError(f"cannot read mamba_type from {value!r}")
    return _MAMBA_ENUM_TO_NAME.get(name, name.lower())


def _mamba_type_value(name: str) -> Any:
    """The value ``MambaSpec(mamba_type=...)`` expects on this build, from a canonical name."""
    if capabilities().mamba_type == "str":
        return name
    enum_cls = resolve("MambaAttentionBackendEnum")
    try:
        return enum_cls[_MAMBA_NAME_TO_ENUM[name]]
    except KeyError as exc:
        raise ValueError(
            f"mamba_type={name!r} is unknown; expected one of {sorted(_MAMBA_NAME_TO_ENUM)}"
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


def kv_cache_tensors(kv_cache_config: Any) -> list[tuple[int, list[str]]]:
    """(size, layer names) for each backing tensor of a ``KVCacheConfig``."""
    out = []
    for tensor in kv_cache_config.kv_cache_tensors:
        names = getattr(tensor, "shared_by", None)
        if names is None:
            names = tensor.layers
        out.append((int(tensor.size), list(names)))
    return out


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


@dataclass(frozen=True)
class GroupFacts:
    """What the connector needs to know about one KV cache group."""

    index: int
    kind: SpecKind
    block_size: int
    page_size_bytes: int
    layer_names: tuple[str, ...]
    mamba_type: str | None = None
    sliding_window: int | None = None


def group_facts(kv_cache_config: Any) -> list[GroupFacts]:
    """One ``GroupFacts`` per KV cache group, block sizes as the config resolved them."""
    facts = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = spec_kind(spec)
        facts.append(GroupFacts(
            index=index,
            kind=kind,
            block_size=int(spec.block_size),
            page_size_bytes=int(spec.page_size_bytes),
            layer_names=tuple(group.layer_names),
            mamba_type=mamba_type_name(spec) if kind is SpecKind.MAMBA else None,
            sliding_window=getattr(spec, "sliding_window", None)
            if kind is SpecKind.SLIDING_WINDOW else None,
        ))
    return facts


def has_mamba_groups(kv_cache_config: Any) -> bool:
    return any(f.kind is SpecKind.MAMBA for f in group_facts(kv_cache_config))
