"""KV cache specs and configs, normalised across vLLM releases.

Reading only: the builders tests use to construct specs and configs on every build live in
``tests/testkit/vllm_builders.py``. What moved: ``AttentionSpec`` became keyword-only (0.17),
``MambaSpec.mamba_type`` went from a str (<= 0.20) to ``MambaAttentionBackendEnum`` (0.22),
``KVCacheTensor.shared_by`` became ``layers`` plus strides (0.34), and hybrid models raise
the attention block size, so a group's block size is read from the ``KVCacheConfig``, never
from ``--block-size``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from vllm_flagcx.compat.capabilities import capabilities
from vllm_flagcx.compat.probe import resolve
from vllm_flagcx.compat.vllm_types import KVCacheConfigLike


class SpecKind(str, enum.Enum):
    """The layer kinds a transfer plan distinguishes."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla"
    MAMBA = "mamba"


# Canonical Mamba layer names: the 0.20 strings; 0.22's enum members map onto them.
MAMBA_ENUM_TO_NAME = {
    "MAMBA1": "mamba1",
    "MAMBA2": "mamba2",
    "SHORT_CONV": "short_conv",
    "LINEAR": "linear_attention",
    "GDN_ATTN": "gdn_attention",
    "CUSTOM": "custom",
}
MAMBA_NAME_TO_ENUM = {v: k for k, v in MAMBA_ENUM_TO_NAME.items()}


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
    return MAMBA_ENUM_TO_NAME.get(name, name.lower())


def attention_groups(kv_cache_config: KVCacheConfigLike) -> list[tuple[int, Any]]:
    """(index, group) of the groups whose layers hold K/V attention caches (full or
    sliding window; not MLA latents, not Mamba state): the ones a backend's declared
    dimensions describe."""
    return [(i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups)
            if spec_kind(g.kv_cache_spec) in (SpecKind.FULL_ATTENTION,
                                              SpecKind.SLIDING_WINDOW)]


def kv_cache_tensors(kv_cache_config: KVCacheConfigLike) -> list[tuple[int, list[str]]]:
    """(size, layer names) for each backing tensor of a ``KVCacheConfig``."""
    out = []
    shared_by = capabilities().kv_cache_tensor_layers == "shared_by"
    for tensor in kv_cache_config.kv_cache_tensors:
        names = getattr(tensor, "shared_by" if shared_by else "layers")
        out.append((int(tensor.size), list(names)))
    return out


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


def group_facts(kv_cache_config: KVCacheConfigLike) -> list[GroupFacts]:
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


def has_mamba_groups(kv_cache_config: KVCacheConfigLike) -> bool:
    return any(f.kind is SpecKind.MAMBA for f in group_facts(kv_cache_config))
