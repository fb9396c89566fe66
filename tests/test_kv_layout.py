"""Region extraction from KV tensors shaped the way each vLLM release hands them over."""

from __future__ import annotations

import pytest
import torch
from testkit import pd_harness as pd
from testkit import vllm_harness as harness

from vllm_flagcx.compat import kv_layout
from vllm_flagcx.compat.attention import ATTENTION_DIMS
from vllm_flagcx.layout.regions import RegionError


@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_mamba_page_tensor_equals_state_views(conv_layout):
    """0.34 hands one int8 page per block; <= 0.22 hands [conv, ssm]: same regions."""
    config = pd.rank_kv_cache_config(1, 8, conv_layout=conv_layout)
    caches = pd.allocate(config, conv_layout, seed=0)
    group = config.kv_cache_groups[1]
    name, spec = group.layer_names[0], group.kv_cache_spec
    conv, _ = caches.caches[name]
    page = torch.as_strided(caches.raw[0], (8, spec.page_size_bytes),
                            (spec.page_size_bytes, 1), storage_offset=0)
    assert page.data_ptr() == conv.data_ptr()
    from_views = kv_layout.mamba_regions(name, caches.caches[name], spec, 1, 1, conv_layout,
                                         None)
    from_page = kv_layout.mamba_regions(name, page, spec, 1, 1, conv_layout, None)
    assert from_views == from_page


def test_layer_first_and_blocks_first_attention():
    dense = pd.dense_rank_kv_cache_config(1, 8)
    caches = pd.allocate(dense, "SD", seed=0)
    regions = kv_layout.regions_for_kv_caches(caches.caches, dense, 1, 2, "SD")
    assert [r.name.rsplit(".", 1)[1] for r in regions] == ["k", "v", "k", "v"]
    hybrid = pd.rank_kv_cache_config(1, 8)
    caches = pd.allocate(hybrid, "SD", seed=0)
    regions = kv_layout.regions_for_kv_caches(caches.caches, hybrid, 1, 2, "SD")
    kinds = {r.layer: r.name.rsplit(".", 1)[1] for r in regions}
    assert {kinds[n] for n in harness.HybridLayout().attention_layers} == {"kv"}
    assert {kinds[n] for n in harness.HybridLayout().gdn_layers} == {"state"}


def test_nhd_attention_moves_whole_blocks_only():
    """Heads inside each token (NHD: TRITON_ATTN, FLASHINFER's NHD order): one section
    that says it cannot be split per head; a per-head peer is refused by that name."""
    dense = pd.dense_rank_kv_cache_config(1, 4)
    spec = dense.kv_cache_groups[0].kv_cache_spec
    nhd = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)  # heads inside tokens
    k_region, _ = kv_layout.attention_regions("l", nhd, spec, 0, tp_size=1,
                                              total_kv_heads=2)
    (section,) = k_region.sections
    assert section.name.endswith("nhd_unsplittable") and section.units == 1
    assert section.unit_bytes == 16 * 2 * 64 * 2  # the whole K block
    triton = torch.zeros(4, 2, 16, 2, 64, dtype=torch.bfloat16)  # (B, 2, N, H, D)
    (region,) = kv_layout.attention_regions("l", triton, spec, 0, tp_size=1,
                                            total_kv_heads=2)
    assert [s.name for s in region.sections] == ["k_heads_nhd_unsplittable",
                                                 "v_heads_nhd_unsplittable"]
    with pytest.raises(RegionError, match="ambiguous"):
        kv_layout.attention_regions("l", torch.zeros(2, 2, 16, 2, 64), spec, 0, 1, 2)


def test_k_and_v_inside_each_token_move_as_whole_blocks():
    """FLEX_ATTENTION on vLLM 0.23-0.25: logical (B, 2, N, H, D) stored as (B, N, 2, H, D),
    so a block of K is not one run but the whole block is: one region per layer whose
    single unsplittable unit is the block (K and V together); equal TP sizes only."""
    dense = pd.dense_rank_kv_cache_config(1, 4)
    spec = dense.kv_cache_groups[0].kv_cache_spec
    physical = torch.zeros(4, 16, 2, 2, 64, dtype=torch.bfloat16)  # (B, N, 2, H, D)
    cache = physical.permute(0, 2, 1, 3, 4)  # what the backend hands: (B, 2, N, H, D)
    (region,) = kv_layout.attention_regions("l", cache, spec, 0, tp_size=1,
                                            total_kv_heads=2, dims="B2NHD")
    (section,) = region.sections
    assert section.name.endswith("nhd_unsplittable") and section.units == 1
    assert section.unit_bytes == region.block_bytes == 16 * 2 * 2 * 64 * 2
    assert region.base == physical.data_ptr() and region.num_blocks == 4


@pytest.mark.parametrize(("dims", "regions_sections"), [
    ("2BNHD", {"l.k": [("heads_nhd_unsplittable", 0, 1, 4096)],
               "l.v": [("heads_nhd_unsplittable", 0, 1, 4096)]}),
    ("B2NHD", {"l.kv": [("k_heads_nhd_unsplittable", 0, 1, 4096),
                        ("v_heads_nhd_unsplittable", 4096, 1, 4096)]}),
    ("2BHND", {"l.k": [("heads", 0, 2, 2048)], "l.v": [("heads", 0, 2, 2048)]}),
    ("B2HND", {"l.kv": [("k_heads", 0, 2, 2048), ("v_heads", 4096, 2, 2048)]}),
])
def test_declared_dims_name_k_v_and_heads_even_with_two_blocks_and_two_heads(
        dims, regions_sections):
    """With the backend's declared dimensions (contiguous here), a cache of 2 blocks and
    2 heads, whose shape alone is ambiguous, gives its layout's regions: K and V apart when
    K/V is outermost, K+V per block otherwise; per-head sections (2 x 16 tokens x 64 x 2 B)
    where heads are outside tokens (HND, CPU_ATTN's "2BHND"), one unsplittable section
    where they are inside (NHD)."""
    assert set(dims) == set("2BNHD") and dims in ATTENTION_DIMS
    dense = pd.dense_rank_kv_cache_config(1, 2)
    spec = dense.kv_cache_groups[0].kv_cache_spec
    sizes = {"2": 2, "B": 2, "N": 16, "H": 2, "D": 64}
    cache = torch.zeros(*(sizes[c] for c in dims), dtype=torch.bfloat16)
    regions = kv_layout.attention_regions("l", cache, spec, 0, 1, 2, dims=dims)
    got = {r.name: [(x.name, x.offset, x.units, x.unit_bytes) for x in r.sections]
           for r in regions}
    assert got == regions_sections
    assert all(r.num_blocks == 2 for r in regions)
    with pytest.raises(RegionError, match="ambiguous"):  # what the shape alone gives
        kv_layout.attention_regions("l", cache, spec, 0, 1, 2)


def test_declared_dims_that_disagree_with_the_spec_are_refused_by_name():
    dense = pd.dense_rank_kv_cache_config(1, 4)
    spec = dense.kv_cache_groups[0].kv_cache_spec
    cache = torch.zeros(2, 4, 16, 2, 64)  # (2, B, N, H, D) read as if (2, B, H, N, D)
    with pytest.raises(RegionError, match="KV heads"):
        kv_layout.attention_regions("l", cache, spec, 0, 1, 2, dims="2BHND")


def test_packed_kv_034_shape():
    dense = pd.dense_rank_kv_cache_config(1, 4)
    spec = dense.kv_cache_groups[0].kv_cache_spec
    packed = torch.zeros(4, 2, 16, 2 * 64 * 2, dtype=torch.int8)  # [B, H, N, C]
    (region,) = kv_layout.attention_regions("l", packed, spec, 0, 1, 2)
    assert region.sections[0].units == 2 and region.block_bytes == 2 * 16 * 256


def test_every_importable_backend_contract_is_read_or_skipped_by_name():
    """``testkit.backend_layouts`` reads each attention backend this vLLM imports from its
    own shape and stride order; one it cannot read is named with why, never dropped."""
    from testkit import backend_layouts as bl

    layouts = bl.backend_layouts()
    imported = [n for n, loc in bl.BACKENDS.items() if bl._import(loc) is not None]
    assert imported, "no attention backend class imports in this vLLM"
    for name in imported:
        cls = bl._import(bl.BACKENDS[name])
        assert f"backend:{name}" in layouts or cls.__name__ in bl.SKIPPED, name
    for physical, perm in layouts.values():
        logical = "".join(physical[i] for i in perm)
        assert logical in ATTENTION_DIMS and sorted(physical) == sorted("2BNHD")


def test_one_run_reads_the_order_from_the_strides():
    t = torch.zeros(2, 3, 4, 5)
    assert kv_layout.one_run(t) and kv_layout.one_run(t.permute(3, 1, 0, 2))
    assert kv_layout.one_run(t[:1]) and kv_layout.one_run(t[:1].transpose(0, 3))
    assert not kv_layout.one_run(t[:, :1])  # every other 20 elements: gaps
    assert not kv_layout.one_run(t[..., :4])  # a padded last dimension: gaps


def test_a_padded_head_dimension_is_refused_not_counted():
    """A head size padded in memory (a layout no build declares today): every per-head
    byte count would be off by the padding, so registration refuses, naming it."""
    dense = pd.dense_rank_kv_cache_config(1, 8)
    caches = pd.allocate(dense, "SD", seed=0)
    padded = {}
    for name, cache in caches.caches.items():
        wide = torch.zeros(*cache.shape[:-1], cache.shape[-1] + 8, dtype=cache.dtype)
        padded[name] = wide[..., :cache.shape[-1]]
    with pytest.raises(RegionError, match=r"one block of K .*not one contiguous run"):
        kv_layout.regions_for_kv_caches(padded, dense, 1, 2, "SD", attention_dims={0: "2BNHD"})


def test_a_mamba_page_whose_ssm_does_not_follow_its_conv_is_refused():
    config = pd.rank_kv_cache_config(1, 8, conv_layout="SD")
    caches = pd.allocate(config, "SD", seed=0)
    group = config.kv_cache_groups[1]
    name, spec = group.layer_names[0], group.kv_cache_spec
    conv, ssm = caches.caches[name]
    elsewhere = torch.empty_like(ssm)  # the same shape, another allocation
    with pytest.raises(RegionError, match="ssm state starts"):
        kv_layout.mamba_regions(name, [conv, elsewhere], spec, 1, 1, "SD", None)
