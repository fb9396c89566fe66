"""Byte-for-byte transfers over the KV caches vLLM itself allocates, for every
``KVCacheLayout`` member the installed vLLM declares (0.34+: ``allocate_kv_cache`` and
``create_kv_cache_views`` build each layer's ``[B, H, N, C]`` view in that member's memory
order).

The expected values never come from the planner: every element of prefill's caches is an
encoding of (layer, block, global head, token, channel) written through vLLM's logical
view, and every element decode reads back through its own logical view is checked against
that encoding; blocks outside the request keep a sentinel. Between them runs only the
product: ``compat.kv_layout`` reads the regions from the tensors vLLM handed over,
``layout.plans`` plans each (prefill rank, decode rank) pair, and the planned byte ranges
are copied as written (the transports' copies are tested on their own). A layout whose
block is not one contiguous run must be refused at registration by name; NHD orders
between unequal TP sizes must be refused by the plan, naming NHD. Builds without
``KVCacheLayout`` (<= 0.22) hand 5-d caches, covered per backend by
``test_pd_dense_operations`` and ``testkit.backend_layouts``.
"""

from __future__ import annotations

import ctypes
import importlib

import pytest
import torch
from testkit import vllm_builders

from vllm_flagcx.compat import kv_layout
from vllm_flagcx.layout import plans
from vllm_flagcx.layout.regions import RegionError

layouts_module = pytest.importorskip("vllm.v1.kv_cache_layout",
                                     reason="this vLLM has no KVCacheLayout (<= 0.22)")
KVCacheLayout = layouts_module.KVCacheLayout
allocate_kv_cache = importlib.import_module("vllm.v1.worker.utils").allocate_kv_cache
compute_layout_strides = importlib.import_module(
    "vllm.v1.kv_cache_interface").compute_layout_strides

GLOBAL_HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS, LAYERS = 4, 8, 16, 6, 2
SENTINEL = -1.0
# Per layout: does a block's [H, N, C] form one contiguous run (what can be moved per
# block), and are heads outside tokens (HND: sliceable between TP sizes)?
MOVABLE = {"LBHNC": "HND", "BLHNC": "HND", "LBNHC": "NHD", "BLNHC": "NHD"}
TP_PAIRS = [(1, 1), (2, 2), (2, 1), (1, 2)]


def _config(tp: int, layout: KVCacheLayout):
    """A real KVCacheConfig of one tensor holding both layers, strided as vLLM places
    them for ``layout``."""
    spec = vllm_builders.make_full_attention_spec(
        block_size=BLOCK, num_kv_heads=GLOBAL_HEADS // tp, head_size=HEAD_SIZE,
        dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    # the layer and block strides vLLM's own planner derives for this member
    layer_stride, block_stride = compute_layout_strides(spec, NUM_BLOCKS, LAYERS, layout)[:2]
    tensor = vllm_builders.resolve("KVCacheTensor")(
        size=spec.page_size_bytes * NUM_BLOCKS * LAYERS, layers=names,
        layer_stride=layer_stride, block_stride=block_stride)
    group = vllm_builders.resolve("KVCacheGroupSpec")(layer_names=names, kv_cache_spec=spec)
    return vllm_builders.resolve("KVCacheConfig")(num_blocks=NUM_BLOCKS,
                                                  kv_cache_tensors=[tensor],
                                                  kv_cache_groups=[group])


def _encoding(layer: int, view: torch.Tensor, rank: int) -> torch.Tensor:
    """Value of every element of one rank's ``[B, H, N, C]`` view: its layer, block,
    global head, token and channel, exact in float32."""
    b, h, n, c = (torch.arange(s).view(*(s if i == j else 1 for j in range(4)))
                  for i, s in enumerate(view.shape))
    heads = view.shape[1]
    code = (((layer * NUM_BLOCKS + b) * GLOBAL_HEADS + rank * heads + h) * BLOCK + n)
    return (code * view.shape[3] + c).to(torch.float32)


def _rank_caches(tp: int, layout: KVCacheLayout, fill: str) -> list[dict[str, torch.Tensor]]:
    out = []
    for rank in range(tp):
        caches = allocate_kv_cache(_config(tp, layout), torch.device("cpu"), layout)
        for layer, view in enumerate(caches.values()):
            view.copy_(_encoding(layer, view, rank) if fill == "encoded"
                       else torch.full(view.shape, SENTINEL))
        out.append(caches)
    return out


def _move(p_caches, d_caches, p_tp, d_tp, layout, p_blocks, d_blocks):
    """Regions from the views (``compat.kv_layout``), one plan per rank pair
    (``layout.plans``), the planned ranges copied; returns the bytes moved."""
    p_config, d_config = _config(p_tp, layout), _config(d_tp, layout)
    p_regions = [kv_layout.regions_for_kv_caches(c, p_config, p_tp, GLOBAL_HEADS, "DS")
                 for c in p_caches]
    d_regions = [kv_layout.regions_for_kv_caches(c, d_config, d_tp, GLOBAL_HEADS, "DS")
                 for c in d_caches]
    moved = 0
    for d_rank in range(d_tp):
        for p_rank in range(p_tp):
            plan = plans.plan_transfer(p_regions[p_rank], d_regions[d_rank], [p_blocks],
                                       [d_blocks], plans.RankPair(p_rank, p_tp, d_rank, d_tp))
            for src, dst, length in zip(plan.src.tolist(), plan.dst.tolist(),
                                        plan.length.tolist(), strict=True):
                ctypes.memmove(dst, src, length)
            moved += plan.num_bytes
    return moved


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_every_element_of_vllms_own_views_arrives_or_the_layout_is_refused(layout, p_tp,
                                                                          d_tp):
    _check_pair(layout, p_tp, d_tp)


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_a_flex_attention_pair_moves_whole_blocks_or_is_refused_by_name(p_tp, d_tp):
    """FLEX_ATTENTION supports only LBNHC, so vLLM's own resolver overrides the HND the
    connector asks for (with a warning only): the pair must then move every element at
    equal TP and be refused naming NHD otherwise (it moved one token per block before)."""
    from testkit import vllm_harness as harness

    utils = importlib.import_module("vllm.v1.attention.backends.utils")
    flex = importlib.import_module(
        "vllm.v1.attention.backends.flex_attention").FlexAttentionBackend
    config = harness.make_vllm_config(kv_role="kv_both")
    assert utils.get_kv_connector_cache_layout(config) == "HND"  # what FlagCXConnector asks
    layout = utils.resolve_kv_cache_layout(
        config, [[m.name for m in flex.supported_kv_cache_layouts()]])
    assert layout.name == "LBNHC"  # not the connector's HND: vLLM chose for the backend
    _check_pair(layout, p_tp, d_tp)


def _check_pair(layout, p_tp: int, d_tp: int) -> None:
    p_blocks, d_blocks = [4, 1, 3], [2, 5, 0]
    p_caches = _rank_caches(p_tp, layout, "encoded")
    d_caches = _rank_caches(d_tp, layout, "sentinel")
    kind = MOVABLE.get(layout.name)
    if kind is None:
        with pytest.raises(RegionError, match=r"memory order .*not one contiguous run"):
            _move(p_caches, d_caches, p_tp, d_tp, layout, p_blocks, d_blocks)
        return
    if kind == "NHD" and p_tp != d_tp:
        with pytest.raises(plans.PlanError, match="NHD"):
            _move(p_caches, d_caches, p_tp, d_tp, layout, p_blocks, d_blocks)
        return
    moved = _move(p_caches, d_caches, p_tp, d_tp, layout, p_blocks, d_blocks)
    per_block = LAYERS * GLOBAL_HEADS * BLOCK * 2 * HEAD_SIZE * 4  # float32, K and V
    assert moved == len(p_blocks) * per_block
    for d_rank, caches in enumerate(d_caches):
        for layer, view in enumerate(caches.values()):
            expected = torch.full(view.shape, SENTINEL)
            # what prefill's rank holding the same global heads encoded, block for block
            encoded = _encoding(layer, view, d_rank)
            for bp, bd in zip(p_blocks, d_blocks, strict=True):
                expected[bd] = encoded[bp]
            wrong = (view != expected).nonzero()
            assert wrong.numel() == 0, (
                f"{layout.name} {p_tp}->{d_tp} rank {d_rank} layer {layer}: "
                f"{wrong.shape[0]} wrong elements, first [B,H,N,C] {wrong[0].tolist()}")


def test_the_refusal_names_the_memory_order_and_the_fix():
    layout = KVCacheLayout.LHBNC
    caches = _rank_caches(1, layout, "encoded")[0]
    with pytest.raises(RegionError) as info:
        kv_layout.regions_for_kv_caches(caches, _config(1, layout), 1, GLOBAL_HEADS, "DS")
    message = str(info.value)
    assert "HBNC" in message and "VLLM_KV_CACHE_LAYOUT=LBHNC" in message


def _old_packed_kv_regions(name, cache, group, kind, total_kv_heads):
    """The 4-d reading before the fix: heads = shape[1], one head = stride(1) bytes, heads
    assumed outside tokens (moved one token per block of LBNHC / BLNHC)."""
    from vllm_flagcx.layout import regions as R

    elem = int(cache.element_size())
    return R.attention_packed_kv(layer=name, group=group, kind=kind, base=cache.data_ptr(),
                                 block_stride=int(cache.stride(0)) * elem,
                                 num_blocks=int(cache.shape[0]), heads=int(cache.shape[1]),
                                 global_heads=total_kv_heads,
                                 head_bytes=int(cache.stride(1)) * elem, interleaved=False)


def _digests(caches, tp, layout, rank, peer, sending, blocks):
    from vllm_flagcx.compat import kv_views

    views = kv_views.cache_views(caches, _config(tp, layout), GLOBAL_HEADS, None, [1], rank,
                                 tp, "DS", None)
    return kv_views.layer_digests(views, [blocks], (rank, tp), peer, sending)


@pytest.mark.parametrize("old_reading", [False, True], ids=["fixed", "old-4d-reading"])
@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.BLNHC,
                                    KVCacheLayout.LBHNC], ids=lambda m: m.name)
def test_the_digest_catches_the_old_nhd_reading(monkeypatch, layout, old_reading):
    """Prefill's and decode's full digests over vLLM's own views, after the planned copy:
    equal with today's regions, different with the reading that moved one token per NHD
    block (where the byte sample passed: it compares the plan with itself)."""
    if old_reading:
        monkeypatch.setattr(kv_layout, "packed_kv_regions", _old_packed_kv_regions)
    p_blocks, d_blocks = [4, 1, 3], [2, 5, 0]
    p_caches = _rank_caches(1, layout, "encoded")
    d_caches = _rank_caches(1, layout, "sentinel")
    _move(p_caches, d_caches, 1, 1, layout, p_blocks, d_blocks)
    sent = _digests(p_caches[0], 1, layout, 0, (0, 1), True, p_blocks)
    held = _digests(d_caches[0], 1, layout, 0, (0, 1), False, d_blocks)
    assert len(sent) == LAYERS
    if old_reading and layout.name in ("LBNHC", "BLNHC"):
        assert sent != held
    else:
        assert sent == held


@pytest.mark.parametrize(("p_layout", "d_layout"), [(KVCacheLayout.LBHNC, KVCacheLayout.BLHNC),
                                                    (KVCacheLayout.BLHNC, KVCacheLayout.LBHNC)],
                         ids=lambda m: m.name)
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (4, 1)])
def test_a_right_transfer_between_other_layouts_and_tp_sizes_passes_the_digest(
        p_layout, d_layout, p_tp, d_tp):
    """Between two memory orders and TP sizes, each decode rank's digest of what it
    holds equals, per prefill rank, that rank's digest of what it wrote: the digest
    depends on what the elements mean, not on where they lie."""
    p_blocks, d_blocks = [4, 1, 3], [2, 5, 0]
    p_caches = _rank_caches(p_tp, p_layout, "encoded")
    d_caches = _rank_caches(d_tp, d_layout, "sentinel")
    p_config, d_config = _config(p_tp, p_layout), _config(d_tp, d_layout)
    for d_rank in range(d_tp):
        for p_rank in range(p_tp):
            plan = plans.plan_transfer(
                kv_layout.regions_for_kv_caches(p_caches[p_rank], p_config, p_tp,
                                                GLOBAL_HEADS, "DS"),
                kv_layout.regions_for_kv_caches(d_caches[d_rank], d_config, d_tp,
                                                GLOBAL_HEADS, "DS"),
                [p_blocks], [d_blocks], plans.RankPair(p_rank, p_tp, d_rank, d_tp))
            for src, dst, length in zip(plan.src.tolist(), plan.dst.tolist(),
                                        plan.length.tolist(), strict=True):
                ctypes.memmove(dst, src, length)
    for d_rank in range(d_tp):
        for p_rank in range(p_tp):
            sent = _digests(p_caches[p_rank], p_tp, p_layout, p_rank, (d_rank, d_tp), True,
                            p_blocks)
            held = _digests(d_caches[d_rank], d_tp, d_layout, d_rank, (p_rank, p_tp), False,
                            d_blocks)
            assert sent == held and (len(sent) == LAYERS or not sent)
