"""Memory regions: where each layer's per-block bytes live, and how TP shards them.

Pure data and pure functions (no torch, no vLLM): the worker reads tensor facts through
``vllm_flagcx.compat`` and calls one function per layer kind here. A plan
(``layout.plans``) only needs these descriptions. ``Region`` and ``Section`` are frozen
msgspec Structs, so a worker's fact sheet (``wire.handshake``) carries them as they are:
one region type on both sides of the side channel, no converters.

Model. A ``Region`` is one registered range repeated per block: block ``b`` starts at
``base + b * block_stride``. Inside a block, ``Section``s say which bytes belong to which
TP-sharded unit (a KV head, a conv channel group, an ssm head): ``units`` consecutive units
of ``unit_bytes`` each at ``offset``, optionally repeated ``repeats`` times every
``repeat_stride`` bytes (Mamba conv in the SD layout interleaves channels per state row).

Per layer kind (the seed design note's table):

* attention, layer-first backend (K/V split, FlashAttention): 2 regions, K and V;
* attention, blocks-first (FlashInfer, or any attention layer in a GDN hybrid after vLLM's
  restride): 1 region, K section then V section inside each block;
* Mamba/GDN: 1 region covering the whole page: conv section(s), then ssm at
  ``conv_bytes``, padding to the page end (moved as part of the page when whole blocks go);
* MLA: 1 region of ``page_size_bytes``, replicated (never head-sliced);
* 0.34 ``[B, H, N, C]`` with K||V in C: 1 region, one section of heads of ``N*C`` bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec


class RegionError(ValueError):
    """A cache tensor whose layout the connector cannot describe."""


class Section(msgspec.Struct, frozen=True, array_like=True):
    """``units`` TP-sharded units of ``unit_bytes`` inside each block."""

    name: str
    offset: int
    units: int  # units held by this rank
    unit_bytes: int
    global_units: int  # units of the whole model (all ranks)
    repeats: int = 1
    repeat_stride: int = 0
    replicated: bool = False  # every rank holds all units (MLA latents)

    @property
    def nbytes(self) -> int:
        return self.units * self.unit_bytes


class Region(msgspec.Struct, frozen=True, array_like=True):
    """One registered memory range, described per block."""

    name: str  # "layer.k", "layer.v", "layer.kv", "layer.state", ...
    layer: str
    group: int
    kind: str  # full_attention | sliding_window | mla | mamba
    base: int  # address of block 0
    block_stride: int  # bytes between consecutive blocks
    num_blocks: int
    block_bytes: int  # bytes of one block that belong to the region
    sections: tuple[Section, ...] = ()

    @property
    def end(self) -> int:
        return self.base + self.num_blocks * self.block_stride


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise RegionError(f"{name} must be > 0, got {value}")


def _head_section(name: str, offset: int, heads: int, head_bytes: int, global_heads: int,
                  interleaved: bool) -> Section:
    """Per-head units (HND: each head's tokens contiguous), or, when heads interleave with
    tokens (NHD), one unit per rank that cannot be split across TP ranks: its name says
    so, and a peer that slices otherwise is refused by it (``plans``). The NHD unit counts
    ``global_heads // heads`` rank-shards globally, so the model's page bytes
    (``global_units * unit_bytes``) do not depend on the TP size and the refusal at
    another TP size is the NHD one, not a page-size mismatch."""
    if interleaved and heads > 1:
        return Section(f"{name}_nhd_unsplittable", offset, 1, heads * head_bytes,
                       max(1, global_heads // heads))
    return Section(name, offset, heads, head_bytes, global_heads)


def attention_layer_first(*, layer: str, group: int, kind: str, k_base: int, v_base: int,
                          block_stride: int, num_blocks: int, heads: int, global_heads: int,
                          head_bytes: int, interleaved: bool = False) -> list[Region]:
    """Layer-first K/V split (``(2, num_blocks, ...)``): two regions, K and V."""
    _check_positive(block_stride=block_stride, heads=heads, head_bytes=head_bytes)
    section = _head_section("heads", 0, heads, head_bytes, global_heads, interleaved)
    return [Region(f"{layer}.{part}", layer, group, kind, base, block_stride, num_blocks,
                   heads * head_bytes, (section,))
            for part, base in (("k", k_base), ("v", v_base))]


def attention_blocks_first(*, layer: str, group: int, kind: str, base: int,
                           block_stride: int, num_blocks: int, heads: int, global_heads: int,
                           head_bytes: int, interleaved: bool = False) -> list[Region]:
    """Blocks-first (``(num_blocks, 2, ...)``): one region, K then V in each block."""
    _check_positive(block_stride=block_stride, heads=heads, head_bytes=head_bytes)
    half = heads * head_bytes
    if 2 * half > block_stride:
        raise RegionError(f"{layer}: K+V ({2 * half} bytes) exceed the block stride "
                          f"({block_stride} bytes)")
    sections = (_head_section("k_heads", 0, heads, head_bytes, global_heads, interleaved),
                _head_section("v_heads", half, heads, head_bytes, global_heads, interleaved))
    return [Region(f"{layer}.kv", layer, group, kind, base, block_stride, num_blocks,
                   2 * half, sections)]


def attention_packed_kv(*, layer: str, group: int, kind: str, base: int, block_stride: int,
                        num_blocks: int, heads: int, global_heads: int,
                        head_bytes: int, interleaved: bool = False) -> list[Region]:
    """0.34 ``[B, H, N, C]`` with K||V concatenated in C: one section of whole heads
    (HND), or of one unsplittable unit when heads interleave with tokens (NHD)."""
    _check_positive(block_stride=block_stride, heads=heads, head_bytes=head_bytes)
    if heads * head_bytes > block_stride:
        raise RegionError(f"{layer}: {heads} heads of {head_bytes} bytes exceed the block "
                          f"stride ({block_stride} bytes)")
    section = _head_section("heads", 0, heads, head_bytes, global_heads, interleaved)
    return [Region(f"{layer}.kv", layer, group, kind, base, block_stride, num_blocks,
                   heads * head_bytes, (section,))]


def mla(*, layer: str, group: int, base: int, block_stride: int, num_blocks: int,
        page_bytes: int) -> list[Region]:
    """MLA: the latent page is identical on every rank; one replicated section."""
    _check_positive(block_stride=block_stride, page_bytes=page_bytes)
    section = Section("latent", 0, 1, page_bytes, 1, replicated=True)
    return [Region(f"{layer}.mla", layer, group, "mla", base, block_stride, num_blocks,
                   page_bytes, (section,))]


@dataclass(frozen=True)
class ConvSplit:
    """How the conv channels of one rank split into TP-sharded parts (GDN: Q, K, V)."""

    parts: tuple[tuple[str, int, int], ...]  # (name, local channels, global channels)

    @property
    def channels(self) -> int:
        return sum(local for _, local, _ in self.parts)


def mamba(*, layer: str, group: int, base: int, block_stride: int, num_blocks: int,
          conv_layout: str, conv_split: ConvSplit, conv_state_len: int, conv_elem_bytes: int,
          ssm_heads: int, ssm_global_heads: int, ssm_head_bytes: int,
          page_bytes: int) -> list[Region]:
    """Mamba/GDN: one region, the whole page (conv, then ssm at ``conv_bytes``, padding).

    ``conv_layout`` "DS" stores (channels, state_len): each channel's history is
    contiguous, so a TP part is one range. "SD" stores (state_len, channels): a part is
    ``state_len`` ranges, one per history row.
    """
    _check_positive(block_stride=block_stride, conv_state_len=conv_state_len,
                    conv_elem_bytes=conv_elem_bytes, page_bytes=page_bytes)
    channels = conv_split.channels
    conv_bytes = channels * conv_state_len * conv_elem_bytes
    ssm_bytes = ssm_heads * ssm_head_bytes
    if conv_bytes + ssm_bytes > page_bytes or page_bytes > block_stride:
        raise RegionError(f"{layer}: conv ({conv_bytes} B) + ssm ({ssm_bytes} B) must fit "
                          f"the page ({page_bytes} B) and the page the block stride "
                          f"({block_stride} B)")
    sections: list[Section] = []
    channel_offset = 0
    for name, local, global_ in conv_split.parts:
        if conv_layout == "DS":
            unit = conv_state_len * conv_elem_bytes
            sections.append(Section(f"conv_{name}", channel_offset * unit, local, unit,
                                    global_))
        elif conv_layout == "SD":
            sections.append(Section(f"conv_{name}", channel_offset * conv_elem_bytes, local,
                                    conv_elem_bytes, global_, repeats=conv_state_len,
                                    repeat_stride=channels * conv_elem_bytes))
        else:
            raise RegionError(f"conv_layout must be 'SD' or 'DS', got {conv_layout!r}")
        channel_offset += local
    sections.append(Section("ssm", conv_bytes, ssm_heads, ssm_head_bytes, ssm_global_heads))
    return [Region(f"{layer}.state", layer, group, "mamba", base, block_stride, num_blocks,
                   page_bytes, tuple(sections))]


def storage_spans(regions: Sequence[Region]) -> list[tuple[int, int]]:
    """The disjoint, sorted (address, size) storages that ``regions`` lie in."""
    return unique_storages([(r.base, r.end - r.base) for r in regions])


def unique_storages(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge (start, size) spans into disjoint ranges, so each storage registers once."""
    merged: list[list[int]] = []
    for start, size in sorted(spans):
        end = start + size
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e - s) for s, e in merged]


def model_page_bytes(regions: list[Region], num_groups: int) -> tuple[int, ...]:
    """Per group, the bytes of one layer's block summed over ALL ranks (padding excluded).

    Per-rank page sizes differ whenever P and D use different TP sizes; this does not, so
    it is what the compatibility hash compares.
    """
    out = []
    for group in range(num_groups):
        layer = next((r.layer for r in regions if r.group == group), None)
        total = sum(s.global_units * s.unit_bytes * s.repeats
                    for r in regions if r.group == group and r.layer == layer
                    for s in r.sections)
        out.append(total)
    return tuple(out)


def kernel_ratios(regions: list[Region], num_groups: int, logical_num_blocks: int | None
                  ) -> list[int]:
    """Kernel blocks per logical block, per group (attention kernels may page finer than
    the KV cache manager: vLLM then allocates ``num_blocks * ratio`` kernel blocks)."""
    if not logical_num_blocks:
        return [1] * num_groups
    ratios = []
    for group in range(num_groups):
        counts = {r.num_blocks for r in regions if r.group == group} or {logical_num_blocks}
        if len(counts) != 1 or min(counts) % logical_num_blocks:
            raise ValueError(f"KV cache group {group}: regions hold {sorted(counts)} blocks, "
                             f"not one multiple of the {logical_num_blocks} logical blocks")
        ratios.append(min(counts) // logical_num_blocks)
    return ratios
