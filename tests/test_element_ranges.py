"""The logical sample read as byte ranges (``kv_views.element_ranges``): the ranges the
views' own strides place hold the very bytes torch's indexing reads, for every cache shape
the views know (5-d in both dimension orders, the 4-d ``[B, H, N, C]`` view, MLA); an
index outside a view is refused before any raw read; a view whose channels are not
contiguous falls back to indexing; and a changed element changes that key's crc.

The caches are CPU tensors of the shapes vLLM allocates (no GPU here); the GPU reader is
the same call over device addresses (``tests/test_gpu_ipc.py`` on the H200/H100)."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_flagcx.compat import kv_views
from vllm_flagcx.compat.kv_cache import SpecKind
from vllm_flagcx.connector import integrity
from vllm_flagcx.layout.logical import LayerFacts

BLOCKS, TOKENS, HEADS, CHANNELS = 5, 16, 4, 8


def _cache(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(len(shape) * 7 + shape[0])
    return torch.randn(shape, generator=gen).to(dtype)


CASES = {
    "5d-2BNHD": (lambda: _cache((2, BLOCKS, TOKENS, HEADS, CHANNELS)), SpecKind.FULL_ATTENTION,
                 "2BNHD"),
    "5d-B2NHD": (lambda: _cache((BLOCKS, 2, TOKENS, HEADS, CHANNELS)), SpecKind.FULL_ATTENTION,
                 "B2NHD"),
    # a backend whose memory order puts heads before tokens, read through its letters
    "5d-2BHND": (lambda: _cache((2, BLOCKS, HEADS, TOKENS, CHANNELS)).permute(0, 1, 3, 2, 4),
                 SpecKind.FULL_ATTENTION, "2BNHD"),
    "4d-BHNC": (lambda: _cache((BLOCKS, HEADS, TOKENS, CHANNELS), torch.float32),
                SpecKind.FULL_ATTENTION, None),
    "mla": (lambda: _cache((BLOCKS, TOKENS, 24), torch.float16), SpecKind.MLA, None),
}


def _view(case: str) -> kv_views.AttentionView:
    make, kind, dims = CASES[case]
    parts = kv_views.layer_parts(make(), kind, dims)
    heads = 1 if kind is SpecKind.MLA else HEADS
    return kv_views.AttentionView(tuple(parts), LayerFacts(0, TOKENS, heads), 1)


def _keys(view: kv_views.AttentionView, n: int = 24) -> tuple[list[int], list[int], list[int]]:
    rng = random.Random(3)
    heads = int(view.parts[0].shape[2])
    picks = [(rng.randrange(BLOCKS), rng.randrange(TOKENS), rng.randrange(heads))
             for _ in range(n)]
    return [b for b, _, _ in picks], [s for _, s, _ in picks], [h for _, _, h in picks]


@pytest.mark.parametrize("case", list(CASES))
def test_the_strided_ranges_hold_the_bytes_indexing_reads(case):
    view = _view(case)
    blocks, slots, heads = _keys(view)
    assert view.geometry is not None
    by_ranges = kv_views.crcs_batched([(view, blocks, slots, heads)], integrity.read_host)
    by_torch = kv_views.crcs_batched([(view, blocks, slots, heads)])
    assert by_ranges == by_torch
    assert len(set(by_ranges[0])) > 1  # the keys read different elements


@pytest.mark.parametrize("case", list(CASES))
def test_a_changed_element_changes_exactly_its_keys_crc(case):
    view = _view(case)
    blocks, slots, heads = _keys(view)
    before = kv_views.crcs_batched([(view, blocks, slots, heads)], integrity.read_host)[0]
    part = view.parts[-1]  # V (or the one MLA part): the last range of each key
    part[blocks[0], slots[0], heads[0], -1] += 1
    after = kv_views.crcs_batched([(view, blocks, slots, heads)], integrity.read_host)[0]
    same = [(b, s, h) == (blocks[0], slots[0], heads[0])
            for b, s, h in zip(blocks, slots, heads, strict=True)]
    assert [a != b for a, b in zip(before, after, strict=True)] == same


@pytest.mark.parametrize("key", [(BLOCKS, 0, 0), (0, TOKENS, 0), (0, 0, HEADS), (-1, 0, 0)])
def test_an_index_outside_the_view_is_refused_before_any_read(key):
    view = _view("5d-2BNHD")
    read_calls = []

    def read(ranges):
        read_calls.append(ranges)
        return integrity.read_host(ranges)

    with pytest.raises(IndexError, match="outside a cache view"):
        kv_views.crcs_batched([(view, [key[0]], [key[1]], [key[2]])], read)
    assert not read_calls


def test_channels_that_are_not_contiguous_go_through_indexing():
    cache = _cache((2, BLOCKS, TOKENS, CHANNELS, HEADS)).transpose(3, 4)  # C not innermost
    parts = kv_views.layer_parts(cache, SpecKind.FULL_ATTENTION, "2BNHD")
    view = kv_views.AttentionView(tuple(parts), LayerFacts(0, TOKENS, HEADS), 1)
    blocks, slots, heads = _keys(view)
    assert view.geometry is None
    read_calls = []

    def read(ranges):
        read_calls.append(ranges)
        return integrity.read_host(ranges)

    got = kv_views.crcs_batched([(view, blocks, slots, heads)], read)
    assert not read_calls
    assert got == kv_views.crcs_batched([(view, blocks, slots, heads)])


def test_several_layers_at_once_keep_each_layers_keys_apart():
    views = [_view("5d-2BNHD"), _view("4d-BHNC"), _view("mla")]
    lookups = [(v, *_keys(v, n)) for v, n in zip(views, (3, 5, 2), strict=True)]
    got = kv_views.crcs_batched(lookups, integrity.read_host)
    assert [len(g) for g in got] == [3, 5, 2]
    assert got == [kv_views.crcs_batched([lookup])[0] for lookup in lookups]
