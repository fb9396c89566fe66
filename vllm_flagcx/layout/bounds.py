"""The last check before bytes move: every descriptor of a plan inside registered memory.

Apart from ``plans`` (which makes descriptors) because it is the safety rule of the write
path: block ids are bounded when a plan is made, and this holds each descriptor to the
storages both sides registered, so no plan (or bug in one) can write memory nobody
registered. A plan that names each descriptor's span (``TransferPlan.src_span`` /
``dst_span``) is checked by gathers; a wrong name only costs the search, never a pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_flagcx.layout.plans import PlanError, TransferPlan


def _ends(addr: np.ndarray, length: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end) per descriptor in uint64, and where ``start + length`` wrapped past
    2**64 - 1 (an end that cannot be inside any span): no int64 sum that a length >= 2**63
    turns negative."""
    a = addr.astype(np.uint64)
    end = a + length.astype(np.uint64)
    return a, end, end < a


def _spans(spans: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    starts = np.asarray([s for s, _ in spans], dtype=np.uint64)
    return starts, starts + np.asarray([n for _, n in spans], dtype=np.uint64)


def first_outside(addr: np.ndarray, length: np.ndarray, spans: Sequence[tuple[int, int]]
                  ) -> int | None:
    """Index of the first (address, length) not inside one span, else None. ``spans``
    disjoint and sorted, as ``regions.unique_storages`` returns them."""
    if addr.size == 0:
        return None
    if not spans:
        return 0
    starts, ends = _spans(spans)
    a, end, wrapped = _ends(addr, length)
    idx = np.searchsorted(starts, a, side="right").astype(np.int64) - 1
    bad = (idx < 0) | wrapped | (end > ends[np.maximum(idx, 0)])
    hits = np.flatnonzero(bad)
    return int(hits[0]) if hits.size else None


def named_outside(addr: np.ndarray, length: np.ndarray, spans: Sequence[tuple[int, int]],
                  named: np.ndarray) -> np.ndarray:
    """Per descriptor: True where it is NOT whole inside the span ``named`` names (an index
    out of range counts as outside). Gathers and compares, no search."""
    if not spans:
        return np.ones(addr.shape, dtype=bool)
    starts, ends = _spans(spans)
    idx = np.asarray(named, dtype=np.int64)
    valid = (idx >= 0) & (idx < starts.size)
    idx = np.where(valid, idx, 0)
    a, end, wrapped = _ends(addr, length)
    return ~valid | wrapped | (a < starts[idx]) | (end > ends[idx])


def _first_outside_hinted(addr: np.ndarray, length: np.ndarray,
                          spans: Sequence[tuple[int, int]], named: np.ndarray | None
                          ) -> int | None:
    """``first_outside``, gathering by the plan's span hint and searching only for the
    descriptors whose hint is wrong (a hint never lets a descriptor through)."""
    if named is None or named.shape != addr.shape or not addr.size:
        return first_outside(addr, length, spans)
    missed = np.flatnonzero(named_outside(addr, length, spans, named))
    if not missed.size:
        return None
    i = first_outside(addr[missed], length[missed], spans)
    return None if i is None else int(missed[i])


def check_within(plan: TransferPlan, src_spans: Sequence[tuple[int, int]],
                 dst_spans: Sequence[tuple[int, int]]) -> None:
    """PlanError unless every descriptor reads inside the sender's registered storages and
    writes inside the receiver's announced ones (``regions.unique_storages`` spans).

    Block ids are bounded when a plan is made; this is the last check before bytes move,
    per descriptor, so no plan (or bug in one) can write memory nobody registered. A plan
    whose table knew the spans names each descriptor's span: checked by gathers."""
    for side, addr, spans, named in (("source", plan.src, src_spans, plan.src_span),
                                     ("destination", plan.dst, dst_spans, plan.dst_span)):
        i = _first_outside_hinted(addr, plan.length, spans, named)
        if i is not None:
            raise PlanError(f"descriptor {i}: {side} {int(addr[i]):#x} + {int(plan.length[i])} "
                            f"bytes is outside the registered memory")
