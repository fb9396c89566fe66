"""Transfer plans: (block ids, regions, TP sizes, ranks) -> (src, dst, length) byte arrays.

Pure and vectorised: numpy over blocks; Python loops only over regions and the few
sections inside a block, never over blocks. Lengths are byte counts (fp8 moves as bytes).

A plan is computed for one (sender rank, receiver rank) pair:

* heads (or conv channels, ssm heads) are sliced by the overlap of the two ranks' unit
  ranges, so P_TP > D_TP writes each P rank's slice inside D's block and P_TP < D_TP sends
  the part a D rank holds;
* when units are replicated on the sender side (MLA, or more ranks than KV heads), only the
  sender that the receiver designates (``layout.topology.target_remote_ranks``) sends;
* partial prefix hits: the receiver asks for fewer blocks, the sender sends its tail;
* descriptors contiguous on both sides are merged (whole blocks in consecutive runs
  collapse to one descriptor per run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_flagcx.layout.regions import Region, Section
from vllm_flagcx.layout.topology import head_range, kv_heads_per_rank, target_remote_ranks

_U64 = np.uint64


class PlanError(ValueError):
    """Inputs no plan can serve (mismatched regions, too few blocks, bad TP)."""


@dataclass(frozen=True)
class TransferPlan:
    src: np.ndarray  # uint64 addresses in the sender
    dst: np.ndarray  # uint64 addresses in the receiver
    length: np.ndarray  # uint64 byte counts
    # Per descriptor, the index of the storage span (``regions.storage_spans`` of each
    # side's regions, sorted) it lies in, where the table knew the spans: a hint that lets
    # the bounds checks gather instead of search. A hint is checked, never trusted.
    src_span: np.ndarray | None = None
    dst_span: np.ndarray | None = None

    @property
    def num_descriptors(self) -> int:
        return int(self.src.size)

    @property
    def num_bytes(self) -> int:
        return int(self.length.sum()) if self.length.size else 0

    @staticmethod
    def empty() -> TransferPlan:
        z = np.zeros(0, dtype=_U64)
        return TransferPlan(z, z.copy(), z.copy())


@dataclass(frozen=True)
class RankPair:
    sender_rank: int
    sender_tp: int
    receiver_rank: int
    receiver_tp: int


def expand_to_kernel_blocks(block_ids: Sequence[int] | np.ndarray, ratio: int) -> np.ndarray:
    """Logical block ids -> kernel block ids (each logical block is ``ratio`` kernel ones)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if ratio == 1:
        return ids
    return (ids[:, None] * ratio + np.arange(ratio, dtype=np.int64)[None, :]).reshape(-1)


def align_block_ids(sender_ids: Sequence[int], receiver_ids: Sequence[int],
                    offset: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Pair block ids.

    ``offset`` is the number of leading blocks the receiver already has (partial prefix
    hit on D): it needs the sender's blocks from there on. ``None`` pairs the tails
    (state and sliding-window groups, whose earlier blocks are gone on both sides).
    """
    s = np.asarray(sender_ids, dtype=np.int64)
    r = np.asarray(receiver_ids, dtype=np.int64)
    start = s.size - r.size if offset is None else offset
    if start < 0 or start + r.size > s.size:
        raise PlanError(f"receiver expects {r.size} blocks from block {max(start, 0)} but "
                        f"the sender has {s.size}; the prefill computed fewer tokens than "
                        "decode asked for")
    return s[start:start + r.size], r


def _section_segments(s: Section, r: Section, pair: RankPair) -> list[tuple[int, int, int]]:
    """(src_off, dst_off, length) inside one block for one section pair."""
    nhd = "nhd_unsplittable" in s.name + r.name
    if nhd and (s.name != r.name or s.unit_bytes != r.unit_bytes
                or pair.sender_tp != pair.receiver_tp):
        raise PlanError(f"section {s.name!r} (sender) vs {r.name!r} (receiver): an NHD "
                        "attention cache (heads inside each token: TRITON_ATTN, "
                        "FLASHINFER's NHD order, vLLM 0.34's LBNHC/BLNHC; or K and V inside "
                        "each token: FLEX_ATTENTION on vLLM 0.23-0.25) moves only whole "
                        f"blocks between equal TP sizes (here {pair.sender_tp} -> "
                        f"{pair.receiver_tp}); use the same TP size on both, or an HND "
                        "layout (VLLM_KV_CACHE_LAYOUT=HND, or LBHNC on vLLM >= 0.34)")
    if s.name != r.name or s.unit_bytes != r.unit_bytes or s.repeats != r.repeats:
        raise PlanError(f"section {s.name!r} differs between sender and receiver "
                        f"(unit bytes {s.unit_bytes} vs {r.unit_bytes}, repeats "
                        f"{s.repeats} vs {r.repeats})")
    if s.replicated:
        chosen = target_remote_ranks(pair.receiver_rank, pair.receiver_tp, pair.sender_tp,
                                     1, is_mla=True)
        if pair.sender_rank not in chosen:
            return []
        lo_s = lo_r = 0
        count = s.units
    else:
        units = s.global_units
        for side, sec, tp in (("sender", s, pair.sender_tp), ("receiver", r, pair.receiver_tp)):
            if sec.units != kv_heads_per_rank(tp, units):
                raise PlanError(f"{side} section {sec.name!r} holds {sec.units} units, "
                                f"expected {kv_heads_per_rank(tp, units)} for TP {tp} "
                                f"of {units}")
        if pair.sender_rank not in target_remote_ranks(pair.receiver_rank, pair.receiver_tp,
                                                       pair.sender_tp, units):
            return []
        s_lo, s_hi = head_range(pair.sender_rank, pair.sender_tp, units)
        r_lo, r_hi = head_range(pair.receiver_rank, pair.receiver_tp, units)
        lo, hi = max(s_lo, r_lo), min(s_hi, r_hi)
        if lo >= hi:
            return []
        lo_s, lo_r, count = lo - s_lo, lo - r_lo, hi - lo
    out = []
    for rep in range(s.repeats):
        out.append((s.offset + rep * s.repeat_stride + lo_s * s.unit_bytes,
                    r.offset + rep * r.repeat_stride + lo_r * r.unit_bytes,
                    count * s.unit_bytes))
    return out


def _merge_in_block(segments: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    segments = sorted(segments)
    merged: list[list[int]] = []
    for src, dst, length in segments:
        if merged and merged[-1][0] + merged[-1][2] == src and merged[-1][1] + merged[-1][2] == dst:
            merged[-1][2] += length
        else:
            merged.append([src, dst, length])
    return [(a, b, c) for a, b, c in merged]


def block_segments(sender: Region, receiver: Region, pair: RankPair
                   ) -> list[tuple[int, int, int]]:
    """The per-block byte ranges this sender writes into this receiver for one region."""
    if sender.name != receiver.name or len(sender.sections) != len(receiver.sections):
        raise PlanError(f"region {sender.name!r} does not match receiver region "
                        f"{receiver.name!r}")
    segs: list[tuple[int, int, int]] = []
    for s, r in zip(sender.sections, receiver.sections, strict=True):
        segs += _section_segments(s, r, pair)
    merged = _merge_in_block(segs)
    # Equal TP: the whole block moves, padding included (a Mamba page's tail is part of it).
    if (merged and pair.sender_tp == pair.receiver_tp
            and sender.block_bytes == receiver.block_bytes
            and merged == [(0, 0, sum(sec.nbytes * sec.repeats for sec in sender.sections))]):
        return [(0, 0, sender.block_bytes)]
    return merged


def coalesce(src: np.ndarray, dst: np.ndarray, length: np.ndarray,
             src_span: np.ndarray | None = None, dst_span: np.ndarray | None = None
             ) -> TransferPlan:
    """Merge descriptors that continue each other on both sides (order preserved). A merged
    run keeps its first descriptor's span hints (contiguous bytes lie in one storage span:
    ``unique_storages`` merges touching ranges)."""
    src, dst, length = (np.asarray(a).astype(np.int64, copy=False) for a in (src, dst, length))
    if src.size > 1:
        end = src[:-1] + length[:-1]
        follows = end == src[1:]
        np.add(dst[:-1], length[:-1], out=end)
        follows &= end == dst[1:]
        if follows.any():
            starts = np.flatnonzero(np.concatenate(([True], ~follows)))
            src, dst, length = src[starts], dst[starts], np.add.reduceat(length, starts)
            src_span = src_span[starts] if src_span is not None else None
            dst_span = dst_span[starts] if dst_span is not None else None
    return TransferPlan(src.view(_U64), dst.view(_U64), length.view(_U64), src_span, dst_span)


@dataclass(frozen=True)
class PlanTable:
    """Everything of a plan that does not depend on the request, for one (sender regions,
    receiver regions, rank pair): built once per peer, as NIXL builds its descriptor lists
    at the handshake, so a pull only computes block addresses.

    Each row is one (region, segment) of per-block bytes: a request's descriptors are
    ``base[row] + block_id * stride[row]`` for every block of the row's KV cache group,
    computed for all rows and groups in one pass of a fixed number of numpy operations
    (no Python loop over regions or blocks).
    """

    pair: RankPair
    num_groups: int
    row_group: np.ndarray  # (R,) int64: the KV cache group of each row
    src_base: np.ndarray  # (R,) region base + segment offset
    src_stride: np.ndarray
    dst_base: np.ndarray
    dst_stride: np.ndarray
    length: np.ndarray
    sender_blocks: np.ndarray  # (G,) the fewest blocks of a group's regions (range check)
    receiver_blocks: np.ndarray
    # Per group: every row moves whole blocks (offset 0, length == both strides), so the
    # kernel blocks of one logical block are one range and a kernel ratio scales stride and
    # length instead of multiplying the block ids.
    whole_blocks: tuple[bool, ...]
    # (R,) the storage span of each row's sender / receiver region (None: spans not given)
    row_src_span: np.ndarray | None = None
    row_dst_span: np.ndarray | None = None

    def plan_kernel_ids(self, sender_ids: Sequence[np.ndarray],
                        receiver_ids: Sequence[np.ndarray],
                        scales: Sequence[int] | None = None) -> TransferPlan:
        """The plan for paired block ids, per group: kernel block ids, or logical ones
        for groups whose ``scales[g]`` (their kernel ratio) is > 1."""
        sizes = np.fromiter((ids.size for ids in sender_ids), dtype=np.int64,
                            count=self.num_groups)
        if not self.row_group.size or not sizes.any():
            return TransferPlan.empty()
        s_cat, r_cat = np.concatenate(sender_ids), np.concatenate(receiver_ids)
        scale = None if scales is None or max(scales) == 1 else np.asarray(scales)
        for cat, limits, side in ((s_cat, self.sender_blocks, "sender"),
                                  (r_cat, self.receiver_blocks, "receiver")):
            if scale is not None:
                limits = limits // scale
            bad = (cat < 0) | (cat >= np.repeat(limits, sizes))
            if bad.any():
                group = int(np.searchsorted(np.cumsum(sizes), np.argmax(bad), "right"))
                raise PlanError(f"{side} block id out of range 0..{limits[group] - 1} "
                                f"in KV cache group {group}")
        per_row = sizes[self.row_group]
        row = np.repeat(np.arange(per_row.size), per_row)
        # Index of each descriptor's block in s_cat / r_cat.
        group_start = np.cumsum(sizes) - sizes
        row_start = np.cumsum(per_row) - per_row
        pos = np.arange(row.size) + np.repeat(group_start[self.row_group] - row_start,
                                              per_row)
        src_stride, dst_stride, length = self.src_stride, self.dst_stride, self.length
        if scale is not None:
            row_scale = scale[self.row_group]
            src_stride, dst_stride = src_stride * row_scale, dst_stride * row_scale
            length = length * row_scale
        return coalesce(self.src_base[row] + s_cat[pos] * src_stride[row],
                        self.dst_base[row] + r_cat[pos] * dst_stride[row], length[row],
                        None if self.row_src_span is None else self.row_src_span[row],
                        None if self.row_dst_span is None else self.row_dst_span[row])

    def plan(self, sender_block_ids: Sequence[Sequence[int]],
             receiver_block_ids: Sequence[Sequence[int]],
             kernel_ratios: Sequence[int] | None = None,
             receiver_offsets: Sequence[int | None] | None = None) -> TransferPlan:
        """The plan for one request's logical block ids (see ``plan_transfer``)."""
        if len(sender_block_ids) != self.num_groups or len(receiver_block_ids) != len(
                sender_block_ids):
            raise PlanError(f"sender has {len(sender_block_ids)} KV cache groups, receiver "
                            f"{len(receiver_block_ids)}, the regions {self.num_groups}")
        ratios = kernel_ratios or [1] * self.num_groups
        s_all, r_all, scales = [], [], []
        for g, (s_ids, r_ids) in enumerate(zip(sender_block_ids, receiver_block_ids,
                                               strict=True)):
            offset = receiver_offsets[g] if receiver_offsets else None
            s, r = align_block_ids(s_ids, r_ids, offset)
            ratio = ratios[g]
            if ratio != 1 and self.whole_blocks[g]:
                scales.append(ratio)
            else:
                scales.append(1)
                s, r = expand_to_kernel_blocks(s, ratio), expand_to_kernel_blocks(r, ratio)
            s_all.append(s)
            r_all.append(r)
        return self.plan_kernel_ids(s_all, r_all, scales)


def span_of(region: Region, spans: Sequence[tuple[int, int]]) -> int:
    """The index of the storage span holding ``region`` whole (-1: none does)."""
    for i, (start, size) in enumerate(spans):
        if start <= region.base and region.end <= start + size:
            return i
    return -1


def _row_spans(row_regions: list[Region], spans: Sequence[tuple[int, int]] | None
               ) -> np.ndarray | None:
    """Per row, the storage span of its region (None without spans)."""
    if spans is None:
        return None
    return np.asarray([span_of(r, spans) for r in row_regions], dtype=np.int64)


Member = tuple[Region, Region, list[tuple[int, int, int]]]  # sender, receiver, segments


def _group_facts(members: list[Member], num_groups: int
                 ) -> tuple[np.ndarray, np.ndarray, tuple[bool, ...]]:
    """Per group: the fewest blocks of the sender's and the receiver's regions (a group
    with no rows for this pair moves nothing: any block id is fine there), and whether
    every row moves whole blocks."""
    unbounded = np.iinfo(np.int64).max
    s_blocks = [min((s.num_blocks for s, _, _ in members if s.group == g), default=unbounded)
                for g in range(num_groups)]
    r_blocks = [min((r.num_blocks for _, r, _ in members if r.group == g), default=unbounded)
                for g in range(num_groups)]
    whole = tuple(all(len(segs) == 1 and segs[0][:2] == (0, 0)
                      and s.block_stride == r.block_stride == segs[0][2]
                      for s, r, segs in members if s.group == g) for g in range(num_groups))
    return (np.asarray(s_blocks, dtype=np.int64), np.asarray(r_blocks, dtype=np.int64),
            whole)


def build_table(sender_regions: Sequence[Region], receiver_regions: Sequence[Region],
                pair: RankPair, num_groups: int | None = None,
                sender_spans: Sequence[tuple[int, int]] | None = None,
                receiver_spans: Sequence[tuple[int, int]] | None = None) -> PlanTable:
    """Pair regions by name and lay their per-block segments out as rows. With the two
    sides' storage spans, each row also names the span its region lies in, so the plans
    carry span hints (``TransferPlan.src_span`` / ``dst_span``)."""
    receivers = {r.name: r for r in receiver_regions}
    if len(receivers) != len(receiver_regions) or {r.name for r in sender_regions} != set(
            receivers):
        missing = sorted({r.name for r in sender_regions} ^ set(receivers))
        raise PlanError(f"sender and receiver regions differ: {missing[:6]}")
    if num_groups is None:
        num_groups = 1 + max((r.group for r in sender_regions), default=-1)
    members: list[Member] = []
    for sender in sender_regions:
        if sender.group >= num_groups:
            raise PlanError(f"region {sender.name!r} is in KV cache group {sender.group}, "
                            f"but the request has {num_groups} groups of block ids")
        receiver = receivers[sender.name]
        segs = block_segments(sender, receiver, pair)
        if segs:
            members.append((sender, receiver, segs))
    rows = [(s.group, s.base + a, s.block_stride, r.base + b, r.block_stride, n)
            for s, r, segs in members for a, b, n in segs]
    src_spans = _row_spans([s for s, _, segs in members for _ in segs], sender_spans)
    dst_spans = _row_spans([r for _, r, segs in members for _ in segs], receiver_spans)
    table = np.asarray(rows, dtype=np.int64).reshape(-1, 6)
    s_blocks, r_blocks, whole = _group_facts(members, num_groups)
    return PlanTable(pair, num_groups, table[:, 0].copy(), table[:, 1].copy(),
                     table[:, 2].copy(), table[:, 3].copy(), table[:, 4].copy(),
                     table[:, 5].copy(), s_blocks, r_blocks, whole, src_spans, dst_spans)


def plan_transfer(sender_regions: Sequence[Region], receiver_regions: Sequence[Region],
                  sender_block_ids: Sequence[Sequence[int]],
                  receiver_block_ids: Sequence[Sequence[int]], pair: RankPair,
                  kernel_ratios: Sequence[int] | None = None,
                  receiver_offsets: Sequence[int | None] | None = None) -> TransferPlan:
    """The full plan for one request between one sender rank and one receiver rank.

    Block ids are per KV cache group (HMA), logical; ``kernel_ratios[g]`` expands group
    ``g``'s logical ids to the kernel blocks the regions are laid out in;
    ``receiver_offsets[g]`` is the receiver's local prefix hit in blocks (None: tails).
    A worker planning many requests for one peer keeps ``build_table``'s result and calls
    its ``plan`` instead.
    """
    table = build_table(sender_regions, receiver_regions, pair,
                        num_groups=len(sender_block_ids))
    return table.plan(sender_block_ids, receiver_block_ids, kernel_ratios, receiver_offsets)
