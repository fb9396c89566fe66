"""Transfer plans moved for real: bytes copied by memmove between per-rank numpy buffers.

Each test builds a model-wide ("global") cache of random bytes, derives every P rank's
and D rank's local cache from it the way TP sharding lays them out, plans every
(P rank, D rank) pair, copies the planned bytes, and checks that each D rank now holds
exactly its shard of the global cache. Addresses are real addresses of numpy buffers.
"""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

from vllm_flagcx.layout import bounds, plans, regions
from vllm_flagcx.layout.plans import PlanError, RankPair
from vllm_flagcx.layout.topology import head_range

RNG = np.random.default_rng(1234)
TP_PAIRS = [(1, 1), (2, 1), (4, 2), (1, 2), (2, 4), (4, 1), (1, 4)]


def _copy(plan: plans.TransferPlan) -> None:
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist(), strict=True):
        ctypes.memmove(d, s, n)


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


# ------------------------------------------------------------------ attention (HND)


def _attention_rank(global_kv, rank, tp, heads, layout):
    """Local cache of one rank: (2, B, H_local, N, D) bytes, layer-first or blocks-first."""
    lo, hi = head_range(rank, tp, heads)
    local = np.ascontiguousarray(global_kv[:, :, lo:hi])  # (2, B, h, N, D)
    if layout == "blocks_first":
        local = np.ascontiguousarray(local.transpose(1, 0, 2, 3, 4))  # (B, 2, h, N, D)
    return local


def _attention_regions(local, layout, heads, global_heads, num_blocks):
    head_bytes = local.shape[-1] * local.shape[-2]
    if layout == "layer_first":
        block_stride = local[0].strides[0]
        return regions.attention_layer_first(
            layer="l0", group=0, kind="full_attention", k_base=_addr(local[0]),
            v_base=_addr(local[1]), block_stride=block_stride, num_blocks=num_blocks,
            heads=heads, global_heads=global_heads, head_bytes=head_bytes)
    return regions.attention_blocks_first(
        layer="l0", group=0, kind="full_attention", base=_addr(local),
        block_stride=local.strides[0], num_blocks=num_blocks, heads=heads,
        global_heads=global_heads, head_bytes=head_bytes)


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
@pytest.mark.parametrize("layout", ["layer_first", "blocks_first"])
@pytest.mark.parametrize("global_heads", [2, 4])
@pytest.mark.parametrize("ids", ["contiguous", "scattered"])
def test_attention_hetero_tp_bytes(p_tp, d_tp, layout, global_heads, ids):
    num_blocks, tokens, head_dim = 12, 4, 8  # bytes per element: 1 (fp8-like)
    global_kv = RNG.integers(0, 256, size=(2, num_blocks, global_heads, tokens, head_dim),
                             dtype=np.uint8)
    p_ids = np.arange(2, 8) if ids == "contiguous" else np.array([9, 1, 4, 5, 11, 0])
    d_ids = np.arange(3, 9) if ids == "contiguous" else np.array([2, 10, 6, 7, 0, 3])
    # Place the prompt's blocks at p_ids on P; global block i of the prompt -> p_ids[i].
    prompt = RNG.integers(0, 256, size=(2, len(p_ids), global_heads, tokens, head_dim),
                          dtype=np.uint8)
    global_kv[:, p_ids] = prompt
    p_local = {p: _attention_rank(global_kv, p, p_tp, global_heads, layout) for p in range(p_tp)}
    d_local = {d: np.zeros_like(_attention_rank(global_kv, d, d_tp, global_heads, layout))
               for d in range(d_tp)}
    for p, d in itertools.product(range(p_tp), range(d_tp)):
        hp = len(range(*head_range(p, p_tp, global_heads)))
        hd = len(range(*head_range(d, d_tp, global_heads)))
        plan = plans.plan_transfer(
            _attention_regions(p_local[p], layout, hp, global_heads, num_blocks),
            _attention_regions(d_local[d], layout, hd, global_heads, num_blocks),
            [p_ids.tolist()], [d_ids.tolist()], RankPair(p, p_tp, d, d_tp))
        _copy(plan)
    for d in range(d_tp):
        lo, hi = head_range(d, d_tp, global_heads)
        got = d_local[d] if layout == "layer_first" else d_local[d].transpose(1, 0, 2, 3, 4)
        np.testing.assert_array_equal(got[:, d_ids], prompt[:, :, lo:hi])


def test_contiguous_blocks_coalesce_to_one_descriptor_per_region():
    buf_p = np.zeros((2, 64, 2, 4, 8), dtype=np.uint8)
    buf_d = np.zeros_like(buf_p)
    regs_p = _attention_regions(buf_p, "layer_first", 2, 2, 64)
    regs_d = _attention_regions(buf_d, "layer_first", 2, 2, 64)
    plan = plans.plan_transfer(regs_p, regs_d, [list(range(10, 42))], [list(range(0, 32))],
                               RankPair(0, 1, 0, 1))
    assert plan.num_descriptors == 2  # K run and V run
    assert plan.num_bytes == 2 * 32 * 2 * 4 * 8
    scattered = plans.plan_transfer(regs_p, regs_d, [[1, 3, 5]], [[2, 4, 6]],
                                    RankPair(0, 1, 0, 1))
    assert scattered.num_descriptors == 6


def test_partial_prefix_hit_sends_only_the_tail():
    buf_p = RNG.integers(0, 256, size=(2, 16, 1, 4, 8), dtype=np.uint8)
    buf_d = np.zeros_like(buf_p)
    regs_p = _attention_regions(buf_p, "layer_first", 1, 1, 16)
    regs_d = _attention_regions(buf_d, "layer_first", 1, 1, 16)
    # D already holds the first two blocks of the prompt: it needs P's blocks 2 and 3.
    plan = plans.plan_transfer(regs_p, regs_d, [[3, 4, 5, 6, 7]], [[9, 10]],
                               RankPair(0, 1, 0, 1), receiver_offsets=[2])
    _copy(plan)
    np.testing.assert_array_equal(buf_d[:, [9, 10]], buf_p[:, [5, 6]])
    assert not buf_d[:, :9].any()
    tails = plans.plan_transfer(regs_p, regs_d, [[3, 4, 5, 6, 7]], [[12]], RankPair(0, 1, 0, 1))
    _copy(tails)
    np.testing.assert_array_equal(buf_d[:, 12], buf_p[:, 7])
    with pytest.raises(PlanError, match="receiver expects 5 blocks"):
        plans.plan_transfer(regs_p, regs_d, [[1, 2]], [[1, 2, 3, 4, 5]], RankPair(0, 1, 0, 1))


def test_replicated_heads_one_sender_per_receiver():
    # 1 KV head, P TP 4: every P rank holds the same head; only one may write.
    buf = [np.full((2, 4, 1, 2, 4), p + 1, dtype=np.uint8) for p in range(4)]
    dst = np.zeros_like(buf[0])
    senders = []
    for p in range(4):
        plan = plans.plan_transfer(_attention_regions(buf[p], "layer_first", 1, 1, 4),
                                   _attention_regions(dst, "layer_first", 1, 1, 4),
                                   [[0, 1]], [[2, 3]], RankPair(p, 4, 0, 1))
        if plan.num_descriptors:
            senders.append(p)
            _copy(plan)
    assert senders == [0]
    assert (dst[:, 2:] == 1).all()


def test_mla_is_sent_once_whole():
    page = 64
    src = [RNG.integers(0, 256, size=(8, page), dtype=np.uint8) for _ in range(2)]
    src[1][:] = src[0]
    dst = [np.zeros((8, page), dtype=np.uint8) for _ in range(4)]
    for p, d in itertools.product(range(2), range(4)):
        plan = plans.plan_transfer(
            regions.mla(layer="m", group=0, base=_addr(src[p]), block_stride=page,
                        num_blocks=8, page_bytes=page),
            regions.mla(layer="m", group=0, base=_addr(dst[d]), block_stride=page,
                        num_blocks=8, page_bytes=page),
            [[1, 2]], [[5, 6]], RankPair(p, 2, d, 4))
        assert (plan.num_descriptors > 0) == (p == d * 2 // 4)
        _copy(plan)
    for d in range(4):
        np.testing.assert_array_equal(dst[d][[5, 6]], src[0][[1, 2]])


# ------------------------------------------------------------------ Mamba / GDN


def _gdn_rank(conv_g, ssm_g, rank, tp, parts, layout, page):
    """A rank's GDN page buffer (B, page) and its region; conv = [Q|K|V] shards + ssm."""
    num_blocks, state_len = conv_g.shape[0], conv_g.shape[2]
    chans, split, start = [], [], 0
    for name, width in parts:
        lo, hi = head_range(rank, tp, width)
        chans.append(np.arange(start + lo, start + hi))
        split.append((name, hi - lo, width))
        start += width
    chans = np.concatenate(chans)
    conv = conv_g[:, chans, :]  # (B, C_local, S)   DS
    if layout == "SD":
        conv = conv.transpose(0, 2, 1)
    h_lo, h_hi = head_range(rank, tp, ssm_g.shape[1])
    ssm = ssm_g[:, h_lo:h_hi]
    buf = np.zeros((num_blocks, page), dtype=np.uint8)
    conv_bytes = conv[0].size
    buf[:, :conv_bytes] = conv.reshape(num_blocks, -1)
    buf[:, conv_bytes:conv_bytes + ssm[0].size] = ssm.reshape(num_blocks, -1)
    region = regions.mamba(layer="gdn0", group=1, base=_addr(buf), block_stride=page,
                           num_blocks=num_blocks, conv_layout=layout,
                           conv_split=regions.ConvSplit(tuple(split)), conv_state_len=state_len,
                           conv_elem_bytes=1, ssm_heads=h_hi - h_lo,
                           ssm_global_heads=ssm_g.shape[1], ssm_head_bytes=ssm_g[0, 0].size,
                           page_bytes=page)
    return buf, region


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_gdn_state_hetero_tp_bytes(p_tp, d_tp, layout):
    num_blocks, state_len, page = 6, 3, 512
    parts = (("q", 8), ("k", 8), ("v", 16))
    conv_g = RNG.integers(0, 256, size=(num_blocks, 32, state_len), dtype=np.uint8)
    ssm_g = RNG.integers(0, 256, size=(num_blocks, 4, 4, 4), dtype=np.uint8)
    p_side = {p: _gdn_rank(conv_g, ssm_g, p, p_tp, parts, layout, page) for p in range(p_tp)}
    d_conv = np.zeros_like(conv_g)
    d_ssm = np.zeros_like(ssm_g)
    d_side = {d: _gdn_rank(d_conv, d_ssm, d, d_tp, parts, layout, page) for d in range(d_tp)}
    for p, d in itertools.product(range(p_tp), range(d_tp)):
        plan = plans.plan_transfer(p_side[p][1], d_side[d][1], [[], [4]], [[], [1]],
                                   RankPair(p, p_tp, d, d_tp))
        _copy(plan)
    for d in range(d_tp):
        want, _ = _gdn_rank(conv_g, ssm_g, d, d_tp, parts, layout, page)
        np.testing.assert_array_equal(d_side[d][0][1], want[4])
        assert not d_side[d][0][[0, 2, 3, 4, 5]].any()


def test_gdn_equal_tp_moves_whole_page_including_padding():
    buf_p = RNG.integers(0, 256, size=(4, 512), dtype=np.uint8)
    buf_d = np.zeros_like(buf_p)
    kw = dict(layer="g", group=0, block_stride=512, num_blocks=4, conv_layout="SD",
              conv_split=regions.ConvSplit((("q", 8, 16), ("k", 8, 16), ("v", 16, 32))),
              conv_state_len=3, conv_elem_bytes=1, ssm_heads=4, ssm_global_heads=8,
              ssm_head_bytes=16, page_bytes=512)
    plan = plans.plan_transfer(regions.mamba(base=_addr(buf_p), **kw),
                               regions.mamba(base=_addr(buf_d), **kw), [[2, 3]], [[0, 1]],
                               RankPair(1, 2, 1, 2))
    assert plan.num_descriptors == 1 and plan.num_bytes == 2 * 512
    _copy(plan)
    np.testing.assert_array_equal(buf_d[:2], buf_p[2:])
    other_shard = plans.plan_transfer(regions.mamba(base=_addr(buf_p), **kw),
                                      regions.mamba(base=_addr(buf_d), **kw), [[2]], [[0]],
                                      RankPair(0, 2, 1, 2))
    assert other_shard.num_descriptors == 0  # rank 0 holds none of rank 1's channels


def test_kernel_block_expansion():
    np.testing.assert_array_equal(plans.expand_to_kernel_blocks([3, 7], 2), [6, 7, 14, 15])
    np.testing.assert_array_equal(plans.expand_to_kernel_blocks([3], 1), [3])


def test_mismatched_regions_are_named():
    a = regions.mla(layer="a", group=0, base=4096, block_stride=64, num_blocks=4, page_bytes=64)
    b = regions.mla(layer="b", group=0, base=8192, block_stride=64, num_blocks=4, page_bytes=64)
    with pytest.raises(PlanError, match="regions differ"):
        plans.plan_transfer(a, b, [[1]], [[1]], RankPair(0, 1, 0, 1))
    with pytest.raises(PlanError, match="out of range"):
        plans.plan_transfer(a, a, [[9]], [[1]], RankPair(0, 1, 0, 1))


def test_region_validation():
    with pytest.raises(regions.RegionError, match="conv_layout"):
        regions.mamba(layer="g", group=0, base=0, block_stride=64, num_blocks=1,
                      conv_layout="XY", conv_split=regions.ConvSplit((("q", 1, 1),)),
                      conv_state_len=1, conv_elem_bytes=1, ssm_heads=1, ssm_global_heads=1,
                      ssm_head_bytes=1, page_bytes=64)
    with pytest.raises(regions.RegionError, match="exceed the block stride"):
        regions.attention_blocks_first(layer="l", group=0, kind="full_attention", base=0,
                                       block_stride=16, num_blocks=1, heads=2,
                                       global_heads=2, head_bytes=8)
    assert regions.unique_storages([(0, 10), (5, 10), (100, 4)]) == [(0, 15), (100, 4)]


# ------------------------------------------------------------------ plan tables


def _two_group_regions(base: int, ratio: int, num_blocks: int = 32) -> list[regions.Region]:
    """Group 0: packed attention paged in ``ratio`` kernel blocks per logical block;
    group 1: one MLA-like whole-page region (synthetic addresses: plans only)."""
    page = 4096
    return (regions.attention_packed_kv(layer="a", group=0, kind="full_attention", base=base,
                                        block_stride=page // ratio,
                                        num_blocks=num_blocks * ratio, heads=1,
                                        global_heads=1, head_bytes=page // ratio)
            + regions.mla(layer="m", group=1, base=base + (1 << 24), block_stride=page,
                          num_blocks=num_blocks, page_bytes=page))


@pytest.mark.parametrize("ratio", [1, 4])
def test_table_folds_kernel_blocks_into_the_expanded_plan(ratio):
    """A kernel ratio on whole-block regions scales stride and length instead of
    expanding ids; the descriptors must be exactly those of the explicit expansion."""
    p_side, d_side = _two_group_regions(1 << 30, ratio), _two_group_regions(1 << 34, ratio)
    table = plans.build_table(p_side, d_side, RankPair(0, 1, 0, 1))
    assert table.whole_blocks == (True, True)
    p_ids, d_ids = [[5, 6, 7, 20], [3]], [[1, 2, 9, 10], [4]]
    folded = table.plan(p_ids, d_ids, kernel_ratios=[ratio, 1])
    expanded = table.plan_kernel_ids(
        [plans.expand_to_kernel_blocks(p_ids[0], ratio), np.asarray(p_ids[1])],
        [plans.expand_to_kernel_blocks(d_ids[0], ratio), np.asarray(d_ids[1])])
    for got, want in zip((folded.src, folded.dst, folded.length),
                         (expanded.src, expanded.dst, expanded.length), strict=True):
        np.testing.assert_array_equal(got, want)
    # Contiguous runs on both sides coalesce (5,6,7 -> 1,2 ends where 9 starts).
    assert folded.num_descriptors == 4 and folded.num_bytes == 5 * 4096
    assert folded.src[0] == (1 << 30) + 5 * 4096 and folded.length[0] == 2 * 4096


def test_table_range_checks_name_the_group():
    table = plans.build_table(_two_group_regions(1 << 30, 2), _two_group_regions(1 << 34, 2),
                              RankPair(0, 1, 0, 1))
    with pytest.raises(PlanError, match=r"receiver block id out of range 0\.\.31 in KV cache "
                                         r"group 1"):
        table.plan([[1], [2]], [[1], [32]], kernel_ratios=[2, 1])
    with pytest.raises(PlanError, match=r"sender block id out of range 0\.\.31 in KV cache "
                                         r"group 0"):
        table.plan([[32], [2]], [[1], [3]], kernel_ratios=[2, 1])
    with pytest.raises(PlanError, match="3 KV cache groups"):
        table.plan([[1], [2], [3]], [[1], [2], [3]])


def test_a_table_given_the_spans_names_each_descriptors_span_and_the_check_gathers():
    """With both sides' storage spans, every descriptor carries the index of the span it
    lies in (coalesced runs included); check_within then holds each descriptor to its
    named span, and a wrong hint never lets a descriptor outside through."""
    p_side, d_side = _two_group_regions(1 << 30, 2), _two_group_regions(1 << 34, 2)
    p_spans, d_spans = regions.storage_spans(p_side), regions.storage_spans(d_side)
    assert len(p_spans) == len(d_spans) == 2  # the attention and the MLA storage
    table = plans.build_table(p_side, d_side, RankPair(0, 1, 0, 1), sender_spans=p_spans,
                              receiver_spans=d_spans)
    plan = table.plan([[5, 6, 7, 20], [3, 9]], [[1, 2, 9, 10], [4, 5]], kernel_ratios=[2, 1])
    assert plan.src_span is not None and plan.dst_span is not None
    for addr, named, spans in ((plan.src, plan.src_span, p_spans),
                               (plan.dst, plan.dst_span, d_spans)):
        truth = [next(i for i, (s, n) in enumerate(spans) if s <= a < s + n)
                 for a in addr.tolist()]
        assert named.tolist() == truth
    bounds.check_within(plan, p_spans, d_spans)
    # the same plan with its hints swapped is still accepted (hints are only guesses) ...
    swapped = plans.TransferPlan(plan.src, plan.dst, plan.length, 1 - plan.src_span,
                                 1 - plan.dst_span)
    bounds.check_within(swapped, p_spans, d_spans)
    # ... and a descriptor outside every span is refused whatever its hint names
    bad_dst = plan.dst.copy()
    bad_dst[-1] = np.uint64((1 << 34) + (1 << 26))
    for hint in (plan.dst_span, 1 - plan.dst_span, None):
        with pytest.raises(PlanError, match=f"descriptor {plan.num_descriptors - 1}: "
                                            "destination"):
            bounds.check_within(plans.TransferPlan(plan.src, bad_dst, plan.length,
                                                  plan.src_span, hint), p_spans, d_spans)
    # without the spans the table names nothing, as before
    assert plans.build_table(p_side, d_side, RankPair(0, 1, 0, 1)).plan(
        [[5], [3]], [[1], [4]], kernel_ratios=[2, 1]).dst_span is None


@pytest.mark.parametrize("length", [1 << 63, (1 << 64) - 1, (1 << 64) - (1 << 12)])
@pytest.mark.parametrize("hinted", [False, True])
def test_check_within_refuses_lengths_whose_end_passes_2_to_the_64(length, hinted):
    """A length at or past 2**63 turned the old int64 end negative (inside every span);
    in uint64 an end that wraps past 2**64 - 1 is outside whatever the start."""
    spans = [(1 << 20, 1 << 16)]
    start = np.array([1 << 20], dtype=np.uint64)
    ok = plans.TransferPlan(start, start.copy(), np.array([1 << 16], dtype=np.uint64))
    bounds.check_within(ok, spans, spans)
    hint = np.zeros(1, dtype=np.int64) if hinted else None
    bad = plans.TransferPlan(start, start.copy(), np.array([length], dtype=np.uint64),
                             hint, hint)
    with pytest.raises(PlanError, match="descriptor 0: source"):
        bounds.check_within(bad, spans, spans)
    assert bounds.first_outside(start, np.array([length], dtype=np.uint64), spans) == 0
