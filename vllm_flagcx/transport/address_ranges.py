"""Which registered range holds each descriptor, for thousands of descriptors at once.

A transfer of a 32k-token prompt is ~20,000 descriptors; checking each against every
registered range with a mask per range cost ~300 us of numpy per write on the CPU VM (more
than the GPU copy itself). Sorted, disjoint ranges answer with one binary search per
descriptor instead. Overflow-safe: a descriptor whose end wraps past 2**64 is outside,
never inside (a length near 2**64 must not pass a bounds check by wrapping).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

OUTSIDE = -1
FEW = 2  # up to this many ranges, a compare per range beats a binary search per descriptor


class RangeTable:
    """Half-open ``[lo, hi)`` address ranges; ``index`` answers with positions in the
    order given. Overlapping ranges are allowed: then each descriptor is checked against
    every range and gets one of those holding it; so does every descriptor when there are
    ``FEW`` ranges or fewer (vectorised compares beat a binary search there)."""

    def __init__(self, ranges: Iterable[tuple[int, int]]) -> None:
        pairs = [(int(lo), int(hi)) for lo, hi in ranges]
        if any(hi < lo or lo < 0 for lo, hi in pairs):
            raise ValueError(f"address ranges must have 0 <= lo <= hi: {pairs}")
        self._order = np.argsort(np.array([lo for lo, _ in pairs], dtype=np.uint64),
                                 kind="stable")
        self._lo = np.array([pairs[i][0] for i in self._order], dtype=np.uint64)
        self._hi = np.array([pairs[i][1] for i in self._order], dtype=np.uint64)
        self.disjoint = bool(np.all(self._lo[1:] >= self._hi[:-1])) if pairs else True

    def __len__(self) -> int:
        return int(self._lo.size)

    def index(self, start: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Per descriptor ``[start, start + length)``: the index of a range holding it
        whole, ``OUTSIDE`` (-1) where none does."""
        start = np.asarray(start, dtype=np.uint64)
        end = start + np.asarray(length, dtype=np.uint64)
        sane = end >= start  # False where the end wrapped
        if not len(self):
            return np.full(start.shape, OUTSIDE, dtype=np.int64)
        if self.disjoint and len(self) > FEW:
            pos = np.searchsorted(self._lo, start, side="right").astype(np.int64) - 1
            at = np.maximum(pos, 0)
            held = (pos >= 0) & (end <= self._hi[at]) & sane
            return np.where(held, self._order[at], OUTSIDE)
        out = np.full(start.shape, OUTSIDE, dtype=np.int64)
        for k in range(len(self)):
            held = (start >= self._lo[k]) & (end <= self._hi[k]) & sane
            out = np.where(held, self._order[k], out)
        return out

    def holds(self, start: np.ndarray, length: np.ndarray) -> bool:
        """Every descriptor lies whole inside one range."""
        start = np.asarray(start, dtype=np.uint64)
        if start.size and len(self) == 1:  # reductions only: the common single-pool case
            end = start + np.asarray(length, dtype=np.uint64)
            return bool(start.min() >= self._lo[0] and end.max() <= self._hi[0]
                        and np.all(end >= start))
        return bool(np.all(self.index(start, length) != OUTSIDE))
