"""The rule a prefix-aware router must apply to a decode instance's KV events to predict
its prefix-cache hits after PD (docs/prefix-reuse.md), as vLLM's hybrid coordinator
decides them: a full-attention group serves its longest run of cached blocks from the
start; a sliding-window group needs ``cdiv(window - 1, block_size)`` consecutive cached
blocks ending at the hit (searched from the right); the hit is the shortest of the
groups', repeated until no group shortens it. ``tests/test_prefix_reuse.py`` checks it
against the real KVCacheManager.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence, Set
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupIndex:
    """What a router learned of one KV cache group from BlockStored / BlockRemoved."""

    sliding_window: int | None  # tokens; None: full attention
    block_size: int
    cached: Set[Hashable]


def _sliding_hit(hashes: Sequence[Hashable], limit: int, group: GroupIndex) -> int:
    assert group.sliding_window is not None
    need = -(-(group.sliding_window - 1) // group.block_size)
    run = 0
    for i in range(limit - 1, -1, -1):
        if hashes[i] in group.cached:
            run += 1
            if run >= need:
                return i + run
        else:
            run = 0
    return run  # a run that reached the first block is a hit even if shorter


def hit_blocks(hashes: Sequence[Hashable], groups: Mapping[int, GroupIndex]) -> int:
    """Blocks of ``hashes`` (the request's full blocks up to its last token) decode would
    serve from its prefix cache."""
    limit = len(hashes)
    while True:
        shortest = limit
        for group in groups.values():
            if group.sliding_window is None:
                hit = next((i for i in range(shortest) if hashes[i] not in group.cached),
                           shortest)
            else:
                hit = _sliding_hit(hashes, shortest, group)
            shortest = min(shortest, hit)
        if shortest == limit:
            return limit
        limit = shortest


def naive_hit_blocks(hashes: Sequence[Hashable], groups: Mapping[int, GroupIndex]) -> int:
    """What a router that indexes every stored hash alike counts: the longest run of
    hashes stored in any group (the over-count this rule replaces)."""
    stored = set().union(*(g.cached for g in groups.values()))
    return next((i for i, h in enumerate(hashes) if h not in stored), len(hashes))
