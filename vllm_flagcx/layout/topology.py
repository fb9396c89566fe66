"""The project's own tensor-parallel arithmetic for P/D transfers (pure, no vLLM import).

vLLM's helper (``TpKVTopology`` -> ``TransferTopology``) changed its constructor four times
between 0.13 and 0.34, so the connector does not use it; tests cross-check these functions
against it where the installed build has it.

Conventions: ``tp_ratio`` is signed. ``local_tp // remote_tp`` when local >= remote
(positive: several local ranks share one remote rank), ``-(remote_tp // local_tp)`` when
remote > local (negative: one local rank spans several remote ranks). KV heads are
replicated across ranks when ``tp > num_kv_heads``; MLA latents are always replicated.
"""

from __future__ import annotations

from dataclasses import dataclass


class TopologyError(ValueError):
    """A (local TP, remote TP, heads) combination that no transfer plan can serve."""


def _check(local_tp: int, remote_tp: int) -> None:
    for name, value in (("local_tp", local_tp), ("remote_tp", remote_tp)):
        if not isinstance(value, int) or value < 1:
            raise TopologyError(f"{name} must be a positive integer, got {value!r}")
    if max(local_tp, remote_tp) % min(local_tp, remote_tp) != 0:
        raise TopologyError(
            f"local_tp={local_tp} and remote_tp={remote_tp}: one must divide the other "
            "(pick TP sizes that are multiples of each other)"
        )


def tp_ratio(local_tp: int, remote_tp: int) -> int:
    """Signed ratio: ``local // remote`` (>= 1) or ``-(remote // local)`` (<= -2)."""
    _check(local_tp, remote_tp)
    if local_tp >= remote_tp:
        return local_tp // remote_tp
    return -(remote_tp // local_tp)


def is_kv_replicated(tp: int, num_kv_heads: int) -> bool:
    """True when ranks of a ``tp``-way instance hold copies of the same KV heads."""
    return tp > num_kv_heads


def replicates_kv_cache(tp: int, num_kv_heads: int, is_mla: bool) -> bool:
    return is_mla or is_kv_replicated(tp, num_kv_heads)


def kv_heads_per_rank(tp: int, num_kv_heads: int) -> int:
    return max(1, num_kv_heads // tp)


def head_range(rank: int, tp: int, num_kv_heads: int) -> tuple[int, int]:
    """[start, stop) of the global KV heads rank ``rank`` holds."""
    per_rank = kv_heads_per_rank(tp, num_kv_heads)
    # Sharded: rank * per_rank. Replicated (tp > heads): ranks share heads in order.
    start = rank * num_kv_heads // tp
    return start, start + per_rank


def positional_remote_ranks(local_rank: int, local_tp: int, remote_tp: int) -> list[int]:
    """Remote ranks by position alone: ``rank // ratio``, or the ``|ratio|`` ranks
    ``rank*|ratio| ...`` when the remote side is larger (vLLM's rule, heads ignored)."""
    ratio = tp_ratio(local_tp, remote_tp)
    if not 0 <= local_rank < local_tp:
        raise TopologyError(f"local_rank={local_rank} is outside 0..{local_tp - 1}")
    if ratio > 0:
        return [local_rank // ratio]
    return [local_rank * -ratio + i for i in range(-ratio)]


def target_remote_ranks(local_rank: int, local_tp: int, remote_tp: int,
                        num_kv_heads: int, is_mla: bool = False) -> list[int]:
    """Remote ranks local rank ``local_rank`` exchanges KV with: one per distinct head range.

    Starts from the positional rule and drops remote ranks that hold a head range already
    covered (replicated KV: more ranks than heads) or none of the local heads. MLA latents
    are whole on every rank, so one remote rank is enough.
    """
    candidates = positional_remote_ranks(local_rank, local_tp, remote_tp)
    if is_mla:
        return candidates[:1]
    lo, hi = head_range(local_rank, local_tp, num_kv_heads)
    chosen: list[int] = []
    seen: set[tuple[int, int]] = set()
    for remote in candidates:
        r_range = head_range(remote, remote_tp, num_kv_heads)
        if r_range in seen or not (r_range[0] < hi and lo < r_range[1]):
            continue
        seen.add(r_range)
        chosen.append(remote)
    return chosen


def block_size_ratio(local_block_size: int, remote_block_size: int) -> int:
    """How many remote blocks make one local block (P and D may page differently)."""
    if local_block_size % remote_block_size and remote_block_size % local_block_size:
        raise TopologyError(
            f"block sizes {local_block_size} (local) and {remote_block_size} (remote) "
            "must divide each other"
        )
    return max(1, local_block_size // remote_block_size)


@dataclass(frozen=True)
class HeadSlice:
    """The part of a block's head dimension one sender writes into one receiver."""

    src_head_offset: int  # first head, counted within the sender's local heads
    dst_head_offset: int  # first head, counted within the receiver's local heads
    num_heads: int


def head_slice(sender_rank: int, sender_tp: int, receiver_rank: int, receiver_tp: int,
               num_kv_heads: int) -> HeadSlice | None:
    """Overlap of the heads of a sender rank and a receiver rank, or None."""
    s_lo, s_hi = head_range(sender_rank, sender_tp, num_kv_heads)
    r_lo, r_hi = head_range(receiver_rank, receiver_tp, num_kv_heads)
    lo, hi = max(s_lo, r_lo), min(s_hi, r_hi)
    if lo >= hi:
        return None
    return HeadSlice(lo - s_lo, lo - r_lo, hi - lo)
