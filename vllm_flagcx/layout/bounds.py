"""The last check before bytes move: every descriptor inside registered memory.

Apart from ``plans`` (which makes descriptors) because it is the safety rule of the write
path: block ids are bounded when a plan is made, and this holds each descriptor to the
storages both sides registered, so no plan (or bug in one) can write memory nobody
registered. Prefill checks each plan (``check_within``), the transports each batch they
are handed (``RangeTable``), the integrity check its sample ranges (``first_outside``).

One search for all of them (``RangeTable``): a transfer of a 32k-token prompt is ~20,000
descriptors; checking each against every registered range with a mask per range cost
~300 us of numpy per write on the CPU VM (more than the GPU copy itself). Sorted, disjoint
ranges answer with one binary search per descriptor instead, a batch inside one range
with a few reductions (``common``: 4x less CPU than the search at 20,910 descriptors,
benchmarks/b2c_write_checks.py), and a plan that names each descriptor's span
(``TransferPlan.src_span`` / ``dst_span``) by gathers; a wrong name only costs the
search, never a pass. Overflow-safe: a descriptor whose end wraps past 2**64 is outside,
never inside (a length near 2**64 must not pass a bounds check by wrapping).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import numpy as np

from vllm_flagcx.layout.plans import PlanError, TransferPlan

OUTSIDE = -1
_SPAN = 1 << 64
# From this many descriptors on, a table of several ranges first tries ``common`` (a few
# reductions) before a binary search per descriptor; below it, the search is cheaper than
# a try that misses (2-core VM, 40 ranges: a miss cost 5 us at 750 descriptors).
COMMON_FIRST_FROM = 2048
# From this many descriptors on, a caller's hint (``hinted``: gathers, no search) is tried
# before the search; below it the search is cheaper (B2c, 2-core VM, 40 ranges: hints cost
# 1.07-1.13x the search at 140-750 descriptors, 0.65-0.70x at 20,910).
HINTS_FROM = 2048


def _cannot_wrap(start: np.ndarray, length: np.ndarray) -> bool:
    """No ``start + length`` passes 2**64 (two reductions, not a mask per descriptor)."""
    return int(start.max()) + int(length.max()) < _SPAN


class RangeTable:
    """Half-open ``[lo, hi)`` address ranges; ``index`` answers with positions in the
    order given. Overlapping ranges are allowed: then each descriptor is checked against
    every range and gets one of those holding it.

    Disjoint ranges (every registration here) answer with one binary search per
    descriptor into arrays padded with a sentinel at position 0 ("below every range"),
    so the answer takes two gathers and a compare, with no per-descriptor fix-ups; and a
    batch that lies inside one range (``common``, tried by ``locate``) is answered by
    reductions alone."""

    def __init__(self, ranges: Iterable[tuple[int, int]]) -> None:
        pairs = [(int(lo), int(hi)) for lo, hi in ranges]
        if any(hi < lo or lo < 0 for lo, hi in pairs):
            raise ValueError(f"address ranges must have 0 <= lo <= hi: {pairs}")
        self._order = np.argsort(np.array([lo for lo, _ in pairs], dtype=np.uint64),
                                 kind="stable")
        self._lo = np.array([pairs[i][0] for i in self._order], dtype=np.uint64)
        self._hi = np.array([pairs[i][1] for i in self._order], dtype=np.uint64)
        self.disjoint = bool(np.all(self._lo[1:] >= self._hi[:-1])) if pairs else True
        # position 0: below every range (searchsorted answers 0 there): never holds
        self._hi_pad = np.concatenate([np.zeros(1, np.uint64), self._hi])
        self._order_pad = np.concatenate([np.full(1, OUTSIDE, np.int64),
                                          self._order.astype(np.int64)])
        # the ranges in the order given, for ``hinted`` (a gather per descriptor)
        self._lo_given = np.array([lo for lo, _ in pairs], dtype=np.uint64)
        self._hi_given = np.array([hi for _, hi in pairs], dtype=np.uint64)

    def __len__(self) -> int:
        return int(self._lo.size)

    def common(self, start: np.ndarray, length: np.ndarray) -> int | None:
        """The range holding every descriptor when one does (the lowest start and the
        highest end fall in the same range, so everything between does), else None; a
        batch that might wrap past 2**64 gets None (``index`` then decides)."""
        if (not start.size or not self.disjoint or not len(self)
                or not _cannot_wrap(start, length)):
            return None
        first, last = int(start.min()), int((start + length).max())
        k = int(np.searchsorted(self._lo, np.uint64(first), side="right")) - 1
        if k < 0 or last > int(self._hi[k]):
            return None
        return int(self._order[k])

    def index(self, start: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Per descriptor ``[start, start + length)``: the index of a range holding it
        whole, ``OUTSIDE`` (-1) where none does."""
        start = np.asarray(start, dtype=np.uint64)
        length = np.asarray(length, dtype=np.uint64)
        if not len(self) or not start.size:
            return np.full(start.shape, OUTSIDE, dtype=np.int64)
        end = start + length
        if not self.disjoint:
            return self._index_overlapping(start, end)
        at = np.searchsorted(self._lo, start, side="right")  # 0: below every range
        held = end <= self._hi_pad[at]
        if not _cannot_wrap(start, length):
            held &= end >= start  # a wrapped end is small: outside, never inside
        return np.where(held, self._order_pad[at], OUTSIDE)

    def _index_overlapping(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        sane = end >= start
        out = np.full(start.shape, OUTSIDE, dtype=np.int64)
        for k in range(len(self)):
            held = (start >= self._lo[k]) & (end <= self._hi[k]) & sane
            out = np.where(held, self._order[k], out)
        return out

    def hinted(self, start: np.ndarray, length: np.ndarray, hint: np.ndarray
               ) -> np.ndarray | None:
        """``hint`` (a guess, per descriptor, at the index of the range holding it, in the
        order given) where every guess is right: two gathers and compares, no search; None
        when any guess is wrong or the batch might wrap (the caller then searches)."""
        hint = np.asarray(hint)
        if (hint.shape != start.shape or not start.size or not len(self)
                or not _cannot_wrap(start, length)):
            return None
        idx = hint.astype(np.int64, copy=False)
        if int(idx.min()) < 0 or int(idx.max()) >= len(self):
            return None
        if not (np.all(start >= self._lo_given[idx])
                and np.all(start + length <= self._hi_given[idx])):
            return None
        return idx

    def locate(self, start: np.ndarray, length: np.ndarray,
               hint: np.ndarray | None = None) -> int | np.ndarray:
        """Which range holds each descriptor: ``common``'s one range (an int) where the
        batch is worth asking about (one range, or ``COMMON_FIRST_FROM`` descriptors and
        more) and one range holds it all; else ``hint`` where it is right everywhere
        (``hinted``); else ``index``'s answer per descriptor."""
        start = np.asarray(start, dtype=np.uint64)
        length = np.asarray(length, dtype=np.uint64)
        if len(self) == 1 or start.size >= COMMON_FIRST_FROM:
            k = self.common(start, length)
            if k is not None:
                return k
        if hint is not None and start.size >= HINTS_FROM:
            named = self.hinted(start, length, hint)
            if named is not None:
                return named
        return self.index(start, length)

    def holds(self, start: np.ndarray, length: np.ndarray,
              hint: np.ndarray | None = None) -> bool:
        """Every descriptor lies whole inside one range."""
        if not np.size(start):
            return True
        where = self.locate(start, length, hint)
        return isinstance(where, int) or bool(np.all(where != OUTSIDE))


@functools.lru_cache(maxsize=256)
def _span_table(spans: tuple[tuple[int, int], ...]) -> RangeTable:
    """Spans are a registration's or a pinned receiver's: few, reused by every write (a
    table per call cost 30 us a side)."""
    return RangeTable((s, s + n) for s, n in spans)


def first_outside(addr: np.ndarray, length: np.ndarray, spans: Sequence[tuple[int, int]],
                  named: np.ndarray | None = None) -> int | None:
    """Index of the first (address, length) not whole inside one of ``spans`` ((start,
    length) pairs, as ``regions.unique_storages`` returns them), else None. ``named``: a
    guess per descriptor at its span's index (tried first; never lets one through)."""
    if not np.size(addr):
        return None
    key = spans if isinstance(spans, tuple) else tuple(map(tuple, spans))
    where = _span_table(key).locate(addr, length, named)
    if isinstance(where, int):
        return None
    outside = np.flatnonzero(where == OUTSIDE)
    return int(outside[0]) if outside.size else None


def check_within(plan: TransferPlan, src_spans: Sequence[tuple[int, int]],
                 dst_spans: Sequence[tuple[int, int]]) -> None:
    """PlanError unless every descriptor reads inside the sender's registered storages and
    writes inside the receiver's announced ones (``regions.unique_storages`` spans)."""
    for side, addr, spans, named in (("source", plan.src, src_spans, plan.src_span),
                                     ("destination", plan.dst, dst_spans, plan.dst_span)):
        i = first_outside(addr, plan.length, spans, named)
        if i is not None:
            raise PlanError(f"descriptor {i}: {side} {int(addr[i]):#x} + {int(plan.length[i])} "
                            f"bytes is outside the registered memory")
