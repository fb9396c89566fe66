"""Transfer plans: (block ids, regions, TP sizes, ranks) -> (src, dst, length) byte arrays.

Pure and vectorised: numpy over blocks; Python loops only over regions and the few
sections inside a block, never over blocks. Lengths are byte counts (fp8 moves as bytes).

A plan is computed for one (sender rank, receiver rank) pair:

* heads (or conv channels, ssm heads) are sliced by the overlap of the two ranks' unit
  ranges, so P_TP > D_TP writes each P rank's slice inside D's block and P_TP < D_TP sends
  the part a D rank holds;
* when units are replicated on the sender side (MLA, or more ranks than KV heads), only the
  sender that the receiver designates (``compat.topology.target_remote_ranks``) sends;
* partial prefix hits: the receiver asks for fewer blocks, the sender sends its tail;
* descriptors contiguous on both sides are merged (whole blocks in consecutive runs
  collapse to one descriptor per run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_flagcx.compat.topology import head_range, kv_heads_per_rank, target_remote_ranks
from vllm_flagcx.connector.regions import Region, Section

_U64 = np.uint64


class PlanError(ValueError):
    """Inputs no plan can serve (mismatched regions, too few blocks, bad TP)."""


@dataclass(frozen=True)
class TransferPlan:
    src: np.ndarray  # uint64 addresses in the sender
    dst: np.ndarray  # uint64 addresses in the receiver
    length: np.ndarray  # uint64 byte counts

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


def coalesce(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> TransferPlan:
    """Merge descriptors that continue each other on both sides (order preserved)."""
    if src.size <= 1:
        return TransferPlan(src.astype(_U64), dst.astype(_U64), length.astype(_U64))
    follows = (src[:-1] + length[:-1] == src[1:]) & (dst[:-1] + length[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    return TransferPlan(src[starts].astype(_U64), dst[starts].astype(_U64),
                        np.add.reduceat(length, starts).astype(_U64))


def plan_region(sender: Region, receiver: Region, sender_ids: np.ndarray,
                receiver_ids: np.ndarray, pair: RankPair) -> TransferPlan:
    """Descriptors for one region over paired block ids (ids in the region's block units)."""
    segs = block_segments(sender, receiver, pair)
    if not segs or sender_ids.size == 0:
        return TransferPlan.empty()
    for ids, region, side in ((sender_ids, sender, "sender"), (receiver_ids, receiver,
                                                               "receiver")):
        if ids.min() < 0 or ids.max() >= region.num_blocks:
            raise PlanError(f"{side} block id out of range 0..{region.num_blocks - 1} in "
                            f"region {region.name!r}")
    seg = np.asarray(segs, dtype=np.int64)  # (S, 3)
    src = sender.base + sender_ids[:, None] * sender.block_stride + seg[None, :, 0]
    dst = receiver.base + receiver_ids[:, None] * receiver.block_stride + seg[None, :, 1]
    length = np.broadcast_to(seg[None, :, 2], src.shape)
    return coalesce(src.reshape(-1), dst.reshape(-1), np.ascontiguousarray(length).reshape(-1))


def plan_transfer(sender_regions: Sequence[Region], receiver_regions: Sequence[Region],
                  sender_block_ids: Sequence[Sequence[int]],
                  receiver_block_ids: Sequence[Sequence[int]], pair: RankPair,
                  kernel_ratios: Sequence[int] | None = None,
                  receiver_offsets: Sequence[int | None] | None = None) -> TransferPlan:
    """The full plan for one request between one sender rank and one receiver rank.

    Block ids are per KV cache group (HMA), logical; ``kernel_ratios[g]`` expands group
    ``g``'s logical ids to the kernel blocks the regions are laid out in;
    ``receiver_offsets[g]`` is the receiver's local prefix hit in blocks (None: tails).
    """
    receivers = {r.name: r for r in receiver_regions}
    if len(receivers) != len(receiver_regions) or {r.name for r in sender_regions} != set(
            receivers):
        missing = sorted({r.name for r in sender_regions} ^ set(receivers))
        raise PlanError(f"sender and receiver regions differ: {missing[:6]}")
    if len(sender_block_ids) != len(receiver_block_ids):
        raise PlanError(f"sender has {len(sender_block_ids)} KV cache groups, receiver "
                        f"{len(receiver_block_ids)}")
    ratios = list(kernel_ratios or [1] * len(sender_block_ids))
    offsets = list(receiver_offsets or [None] * len(sender_block_ids))
    paired = []
    for g, (s_ids, r_ids) in enumerate(zip(sender_block_ids, receiver_block_ids, strict=True)):
        s, r = align_block_ids(s_ids, r_ids, offsets[g])
        paired.append((expand_to_kernel_blocks(s, ratios[g]),
                       expand_to_kernel_blocks(r, ratios[g])))
    parts = []
    for region in sender_regions:
        s_ids, r_ids = paired[region.group]
        parts.append(plan_region(region, receivers[region.name], s_ids, r_ids, pair))
    parts = [p for p in parts if p.num_descriptors]
    if not parts:
        return TransferPlan.empty()
    return coalesce(np.concatenate([p.src for p in parts]),
                    np.concatenate([p.dst for p in parts]),
                    np.concatenate([p.length for p in parts]))
