"""Block ids per KV cache group, and the hybrid KV cache manager (HMA) rules.

* ``get_unhashed_block_ids_all_groups`` is native from 0.18; on 0.13 it is computed here
  with the same rule (no hash, not the null padding block).
* ``get_block_ids(group_ids=...)`` exists only on 0.34.
* ``NULL_BLOCK_ID`` is exported from 0.20; the null block has always been block 0.
* A ``SupportsHMA`` connector only ever gets ``request_finished_all_groups``.
* HMA: off whenever a connector is configured on 0.13-0.20 unless the user passes
  ``--no-disable-hybrid-kv-cache-manager``; auto (on for SupportsHMA) from 0.22. A Mamba/GDN
  model cannot run without HMA, so we refuse instead of degrading.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_flagcx.compat.capabilities import capabilities
from vllm_flagcx.compat.probe import optional
from vllm_flagcx.compat.vllm_types import KVCacheConfigLike


def null_block_id() -> int:
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
    from vllm_flagcx.compat.kv_cache import has_mamba_groups

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
    from vllm_flagcx.compat.kv_cache import has_mamba_groups

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
