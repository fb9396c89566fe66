"""KV cache specs, configs and block ids per group, normalised across vLLM releases.

Reading only: the builders tests use to construct specs and configs on every build live in
``tests/testkit/vllm_builders.py``. What moved: ``AttentionSpec`` became keyword-only (0.17),
``MambaSpec.mamba_type`` went from a str (<= 0.20) to ``MambaAttentionBackendEnum`` (0.22),
``KVCacheTensor.shared_by`` became ``layers`` plus strides (0.34), and hybrid models raise
the attention block size, so a group's block size is read from the ``KVCacheConfig``, never
from ``--block-size``.

Block ids per KV cache group, and the hybrid KV cache manager (HMA) rules:

* ``get_unhashed_block_ids_all_groups`` is native from 0.18; on 0.13 it is computed here
  with the same rule (no hash, not the null padding block).
* ``get_block_ids(group_ids=...)`` exists only on 0.34.
* ``NULL_BLOCK_ID`` is exported from 0.20; the null block has always been block 0.
* A ``SupportsHMA`` connector only ever gets ``request_finished_all_groups``.
* HMA: off whenever a connector is configured on 0.13-0.20 unless the user passes
  ``--no-disable-hybrid-kv-cache-manager``; auto (on for SupportsHMA) from 0.22. A Mamba/GDN
  model cannot run without HMA, so we refuse instead of degrading.

Mamba/GDN specifics: conv state layout and the N-1 token rule for P/D.

A recurrent state cannot be "partly recomputed": decode must run the last prompt token
itself to derive the state after it. So prefill computes the state after N-1 prompt tokens
and decode recomputes token N (the rule vLLM's NIXL connector adopted in 0.19).

Conv layout: "SD" (state_len, dim) per block is vLLM's default; "DS" (dim, state_len) is
selected by ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` from 0.17. 0.13 has SD only.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_flagcx.compat.capabilities import capabilities
from vllm_flagcx.compat.probe import optional, resolve
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


@functools.cache
def null_block_id() -> int:
    """vLLM's null block (0 where the build names none); asked per request: cached."""
    value = optional("NULL_BLOCK_ID")
    return 0 if value is None else int(value)


def _is_null(block: Any) -> bool:
    return bool(getattr(block, "is_null", False))


def block_ids(blocks: Any, group_ids: Sequence[int] | None = None) -> tuple[list[int], ...]:
    """Block ids per group of a ``KVCacheBlocks``, optionally only some groups."""
    if group_ids is not None and capabilities().block_ids_group_ids == "kwarg":
        return tuple(blocks.get_block_ids(group_ids=list(group_ids)))
    ids = tuple(blocks.get_block_ids())
    if group_ids is None:
        return ids
    return tuple(ids[g] for g in group_ids)


def unhashed_block_ids_all_groups(blocks: Any) -> list[list[int]]:
    """Per group, the ids of blocks without a hash (newly allocated), null blocks skipped."""
    if capabilities().unhashed_block_ids_all_groups == "native":
        return [list(g) for g in blocks.get_unhashed_block_ids_all_groups()]
    return [
        [b.block_id for b in group if b.block_hash is None and not _is_null(b)]
        for group in blocks.blocks
    ]


def strip_null_blocks(ids: Sequence[int]) -> list[int]:
    """Block ids without the null block (sliding-window groups pad with it)."""
    null = null_block_id()
    return [b for b in ids if b != null]


# ----------------------------------------------------------------------------- HMA


@dataclass(frozen=True)
class HmaState:
    enabled: bool
    reason: str


def hma_state(vllm_config: Any) -> HmaState:
    """Whether the hybrid KV cache manager is on for this config, and why."""
    flag = vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    default = capabilities().hma_default
    if flag is None:
        enabled = default == "auto"
        return HmaState(enabled, f"unset, default={default}")
    enabled = not flag
    return HmaState(enabled, f"disable_hybrid_kv_cache_manager={flag}")


class HybridManagerRequired(ValueError):
    """A Mamba/GDN hybrid model is configured with the hybrid KV cache manager off."""


def require_hma_for_mamba(vllm_config: Any, kv_cache_config: KVCacheConfigLike | None) -> None:
    """Refuse-not-degrade: Mamba/GDN state cannot be moved without per-group block ids."""
    if kv_cache_config is None or not has_mamba_groups(kv_cache_config):
        return
    state = hma_state(vllm_config)
    if not state.enabled:
        raise HybridManagerRequired(
            "FlagCXConnector: this model has Mamba/GDN layers, which need the hybrid KV cache "
            f"manager, but it is off ({state.reason}). Fix: pass "
            "--no-disable-hybrid-kv-cache-manager to vllm serve (needed on vLLM 0.13-0.20 "
            "whenever a KV connector is set)."
        )


class HybridRemoteLoadUnsupported(ValueError):
    """This vLLM's scheduler cannot finish remote loads of multi-group requests."""


def require_hybrid_async_load(is_consumer: bool, kv_cache_config: KVCacheConfigLike | None) -> None:
    """Refuse a decode (consumer) role for a hybrid model where vLLM would crash later."""
    if not is_consumer or kv_cache_config is None or len(kv_cache_config.kv_cache_groups) < 2:
        return
    if capabilities().hybrid_async_load == "single_group":
        raise HybridRemoteLoadUnsupported(
            "FlagCXConnector: this vLLM build's scheduler completes remote KV loads for ONE "
            f"KV cache group only, and this model has {len(kv_cache_config.kv_cache_groups)}"
            " (attention + Mamba/GDN, or sliding-window + full attention). Run the decode "
            "(kv_consumer) instance on vLLM >= 0.20; a prefill (kv_producer) instance on "
            "this build works.")


def require_mamba_align_accepts_remote_loads(is_consumer: bool, vllm_config: Any,
                                             kv_cache_config: KVCacheConfigLike | None
                                             ) -> None:
    """Refuse a decode role for a hybrid model with prefix caching where vLLM asserts.

    With prefix caching on, vLLM runs Mamba layers in ``mamba_cache_mode="align"``, and
    0.22's ``Scheduler._mamba_block_aligned_split`` asserts that no external tokens arrive
    ("External KV connector is not verified yet"): the first remote load killed the
    engine. 0.34 dropped the assertion. Read from the scheduler's source (no other trace).
    """
    cache = getattr(vllm_config, "cache_config", None)
    if (not is_consumer or kv_cache_config is None or not has_mamba_groups(kv_cache_config)
            or getattr(cache, "mamba_cache_mode", "none") != "align"):
        return
    if capabilities().mamba_align_external_tokens == "asserts_none":
        raise HybridRemoteLoadUnsupported(
            "FlagCXConnector (decode): prefix caching is on for a hybrid (Mamba/GDN) model, "
            "so vLLM runs mamba_cache_mode='align', and this build's scheduler asserts that "
            "no KV arrives from a connector in that mode (_mamba_block_aligned_split: "
            "'External KV connector is not verified yet'); the first transfer would kill "
            "the engine. Start the decode instance with --no-enable-prefix-caching, or use "
            "vLLM >= 0.34 for decode.")


def conv_state_layout() -> str:
    """"SD" or "DS": how this build stores Mamba conv state."""
    if capabilities().conv_state_layouts == "SD":
        return "SD"
    return "DS" if optional("is_conv_state_dim_first")() else "SD"


def remote_prefill_token_count(num_prompt_tokens: int, has_mamba: bool,
                               held: int | None = None) -> int | None:
    """Tokens decode loads from prefill: N, or N-1 when Mamba/GDN groups exist, and never
    more than the ``held`` tokens prefill says it computed.

    Decode seeded with prefill's first token holds N + 1 prompt tokens, prefill held N:
    decode loads N and computes only the seed. A recurrent state is the state after
    exactly ``held`` tokens, so with Mamba/GDN groups anything but an exact match is
    None: nothing can be loaded, decode computes the prompt itself."""
    wanted = num_prompt_tokens - 1 if has_mamba and num_prompt_tokens > 1 else num_prompt_tokens
    if held is None:
        return wanted
    if has_mamba:
        return wanted if wanted == held else None
    return min(wanted, held)
