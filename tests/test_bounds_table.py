"""RangeTable: which registered range holds each descriptor (the bounds check of every
same-host write, host and GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_flagcx.layout.bounds import COMMON_FIRST_FROM, OUTSIDE, RangeTable


def _u64(values):
    return np.array(values, dtype=np.uint64)


def test_each_descriptor_gets_the_position_of_the_range_holding_it_in_the_given_order():
    table = RangeTable([(5000, 6000), (1000, 2000), (3000, 4000)])
    assert table.disjoint
    got = table.index(_u64([1000, 3500, 5999, 1500]), _u64([1000, 500, 1, 0]))
    assert got.tolist() == [1, 2, 0, 1]


@pytest.mark.parametrize("start,length", [(999, 2), (1999, 2), (2999, 2), (4500, 10),
                                          (6000, 1), (0, 1), (1500, 1600)])
def test_a_descriptor_outside_or_across_ranges_is_outside(start, length):
    table = RangeTable([(1000, 2000), (2000, 3000), (5000, 6000)])
    assert table.index(_u64([start]), _u64([length])).tolist() == [OUTSIDE]
    assert not table.holds(_u64([1000, start]), _u64([1, length]))


def test_a_length_that_wraps_past_2_64_is_outside_not_inside():
    table = RangeTable([(1000, 2000)])
    assert table.index(_u64([1500]), _u64([2**64 - 1000])).tolist() == [OUTSIDE]


def test_overlapping_ranges_are_checked_one_by_one():
    table = RangeTable([(1000, 5000), (2000, 3000)])
    assert not table.disjoint
    got = table.index(_u64([2500, 4000, 900]), _u64([100, 500, 200]))
    assert got[0] in (0, 1) and got[1] == 0 and got[2] == OUTSIDE


def test_an_empty_table_holds_nothing_and_bad_ranges_are_refused():
    assert RangeTable([]).index(_u64([1]), _u64([1])).tolist() == [OUTSIDE]
    with pytest.raises(ValueError, match="lo <= hi"):
        RangeTable([(10, 5)])


def test_the_answer_matches_a_range_by_range_check_on_many_descriptors():
    rng = np.random.default_rng(3)
    ranges = [(int(lo), int(lo) + int(size)) for lo, size in
              zip(np.arange(40) * 10_000 + 100, rng.integers(1, 9_000, 40), strict=True)]
    table = RangeTable(ranges)
    start = rng.integers(0, 410_000, 5_000).astype(np.uint64)
    length = rng.integers(0, 3_000, 5_000).astype(np.uint64)
    got = table.index(start, length)
    for s, n, k in zip(start.tolist(), length.tolist(), got.tolist(), strict=True):
        holders = [i for i, (lo, hi) in enumerate(ranges) if lo <= s and s + n <= hi]
        assert (k == OUTSIDE) if not holders else (k in holders), (s, n, k, holders)


def test_one_range_holds_by_reductions_with_the_same_answer():
    table = RangeTable([(1000, 2000)])
    assert table.holds(_u64([1000, 1500]), _u64([10, 500]))
    assert not table.holds(_u64([1000, 1500]), _u64([10, 501]))
    assert not table.holds(_u64([1500]), _u64([2**64 - 1000]))
    assert table.holds(_u64([]), _u64([]))


def test_common_names_the_one_range_holding_a_whole_batch_or_none():
    table = RangeTable([(5000, 6000), (1000, 2000), (3000, 4000)])
    assert table.common(_u64([1000, 1990, 1500]), _u64([10, 10, 0])) == 1
    assert table.common(_u64([3000, 5000]), _u64([10, 10])) is None  # two ranges
    assert table.common(_u64([1990]), _u64([11])) is None  # past the end
    assert table.common(_u64([500]), _u64([1])) is None  # below every range
    assert table.common(_u64([1500]), _u64([2**64 - 1000])) is None  # wraps
    assert table.common(_u64([]), _u64([])) is None
    assert RangeTable([(1000, 5000), (2000, 3000)]).common(_u64([2500]), _u64([1])) is None


def test_holds_answers_the_same_whether_or_not_it_tries_common_first():
    rng = np.random.default_rng(5)
    table = RangeTable([(k * 10_000, k * 10_000 + 9_000) for k in range(40)])
    for n in (3, COMMON_FIRST_FROM + 1):
        inside = (rng.integers(0, 40, n) * 10_000 + rng.integers(0, 8_000, n)).astype(np.uint64)
        one = (7 * 10_000 + rng.integers(0, 8_000, n)).astype(np.uint64)
        length = np.full(n, 100, np.uint64)
        assert table.holds(inside, length) and table.holds(one, length)
        assert isinstance(table.locate(one, length), int) == (n >= COMMON_FIRST_FROM)
        across = one.copy()
        across[-1] = 8 * 10_000 - 50  # ends past range 7
        assert not table.holds(across, length)


def test_a_right_hint_is_the_answer_and_a_wrong_one_falls_back_to_the_search():
    table = RangeTable([(1000, 2000), (0, 500), (5000, 6000)])  # given out of order
    start, length = _u64([10, 1500, 5990, 400]), _u64([5, 100, 10, 100])
    truth = table.index(start, length)
    assert truth.tolist() == [1, 0, 2, 1]
    right = np.array([1, 0, 2, 1])
    assert table.hinted(start, length, right).tolist() == truth.tolist()
    assert table.locate(start, length, right).tolist() == truth.tolist()  # small: searched
    for wrong in (np.array([0, 0, 2, 1]), np.array([1, 0, 3, 1]), np.array([-1, 0, 2, 1]),
                  np.array([1, 0])):
        assert table.hinted(start, length, wrong) is None
        assert table.locate(start, length, wrong).tolist() == truth.tolist()
    # a descriptor outside every range stays outside whatever the hint names
    outside = _u64([10, 2500]), _u64([5, 10])
    assert table.locate(*outside, np.array([1, 0])).tolist() == [1, OUTSIDE]
    assert not table.holds(*outside, np.array([1, 0]))
    # a length that wraps past 2**64 is never taken on a hint
    wrap = _u64([1000]), _u64([(1 << 64) - 500])
    assert table.hinted(*wrap, np.array([0])) is None
    assert not table.holds(*wrap, np.array([0]))


def test_a_large_batch_takes_a_right_hint_and_still_refuses_what_is_outside():
    from vllm_flagcx.layout.bounds import HINTS_FROM

    ranges = [(k * 10_000, k * 10_000 + 5_000) for k in range(40)][::-1]  # given reversed
    table = RangeTable(ranges)
    rng = np.random.default_rng(7)
    k = rng.integers(0, 40, HINTS_FROM + 100)
    start = _u64((k * 10_000 + rng.integers(0, 4_000, k.size)).tolist())
    length = _u64([64] * k.size)
    hint = 39 - k  # the index of range k in the given (reversed) order
    assert table.locate(start, length, hint).tolist() == table.index(start, length).tolist()
    assert table.hinted(start, length, hint) is not None
    start[5] = np.uint64(7_000)  # between ranges 0 and 1: outside whatever is named
    assert table.hinted(start, length, hint) is None
    assert table.locate(start, length, hint)[5] == OUTSIDE
    assert not table.holds(start, length, hint)
