"""The full logical digest (``layout.digest`` over ``compat.kv_views``): every element a
transfer delivers, keyed by what it means, so a plan that names the wrong bytes fails the
request naming the KV cache group, whatever the layout or TP split of either side.

Pure parts first (the torch digest equals the numpy reference bit for bit; one changed
word, two exchanged blocks or conv sections change it; a rogue reply's digests are
refused), then sabotaged plans on real vLLM Schedulers with the connector's workers: each
breaks the plan narrowly where the byte sample (which compares the plan with itself)
passes, and the request must fail (the hybrid's load is recomputed on decode).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from testkit import pd_harness as pd
from testkit.pd_caches import BLOCK, KV_HEADS, allocate, rank_kv_cache_config

from vllm_flagcx.compat import kv_views
from vllm_flagcx.compat.probe import FEATURES_BY_KEY
from vllm_flagcx.layout import digest, plans

# the sabotages run the hybrid through decode, which the connector refuses where vLLM's
# scheduler cannot finish multi-group remote loads (0.13: tests/test_scheduler.py)
hybrid_decode = pytest.mark.skipif(
    FEATURES_BY_KEY["hybrid_async_load"].probe() == "single_group",
    reason="this vLLM cannot finish remote loads of hybrid requests (decode refused)")

SECTIONS = (("q", 64, 64), ("k", 64, 64), ("v", 128, 128))


def _hybrid(conv_layout: str = "SD", seed: int = 0):
    config = rank_kv_cache_config(1, 12, conv_layout=conv_layout)
    caches = allocate(config, conv_layout, seed)
    views = kv_views.cache_views(caches.caches, config, KV_HEADS, None, [1] * 4, 0, 1,
                                 conv_layout, SECTIONS)
    return config, caches, views


def _bytes(t: torch.Tensor, tokens: int, rows: int) -> np.ndarray:
    return t.contiguous().reshape(tokens, rows, -1).view(torch.uint8).numpy()


def _reference(caches, config, conv_layout: str, ids: list[list[int]]) -> dict[str, int]:
    """Each layer's digest from plain indexing and numpy (``digest.reference``)."""
    out = {}
    for g, group in enumerate(config.kv_cache_groups):
        index = torch.tensor(ids[g])
        for name in group.layer_names:
            cache = caches.caches[name]
            if isinstance(cache, list):  # (conv, ssm)
                conv, ssm = cache[0][index], cache[1][index]
                conv = conv if conv_layout == "DS" else conv.transpose(1, 2)
                parts, at = {}, 0
                for section, local, _ in SECTIONS:
                    parts[f"conv_{section}"] = (_bytes(conv[:, at:at + local], len(ids[g]),
                                                       local), 0)
                    at += local
                parts["ssm"] = (_bytes(ssm, len(ids[g]), ssm.shape[1]), 0)
            else:  # (2, B, N, H, D)
                k, v = cache[0][index], cache[1][index]
                tokens = len(ids[g]) * BLOCK
                parts = {"k": (_bytes(k, tokens, KV_HEADS), 0),
                         "v": (_bytes(v, tokens, KV_HEADS), 0)}
            out[name] = digest.reference(parts, name)
    return out


IDS = [[3, 7, 1, 9], [5], [2], [11]]


@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_the_torch_digest_equals_the_numpy_reference(conv_layout):
    config, caches, views = _hybrid(conv_layout)
    got = kv_views.layer_digests(views, IDS, (0, 1), (0, 1), sending=True)
    assert got == _reference(caches, config, conv_layout, IDS)
    assert len(got) == len(views) and len(set(got.values())) == len(got)


def _digests(views, ids=IDS):
    return kv_views.layer_digests(views, ids, (0, 1), (0, 1), sending=True)


def test_one_changed_word_anywhere_changes_its_layer_digest():
    config, caches, views = _hybrid()
    before = _digests(views)
    attention = config.kv_cache_groups[0].layer_names[0]
    gdn = config.kv_cache_groups[1].layer_names[0]
    for name, tensor, at in [(attention, caches.caches[attention][0], (7, 0, 0, 0)),
                             (attention, caches.caches[attention][1], (9, BLOCK - 1, 1, 255)),
                             (gdn, caches.caches[gdn][0], (5, 2, 100)),
                             (gdn, caches.caches[gdn][1], (5, 3, 31, 31))]:
        bits = tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)
        bits[at] ^= 1  # the lowest bit of one element
        after = _digests(views)
        assert after[name] != before[name], (name, at)
        assert {n for n in after if after[n] != before[n]} == {name}
        bits[at] ^= 1
    assert _digests(views) == before
    tensor = caches.caches[attention][0]
    tensor[0, 0, 0, :8] = 0  # a block outside the request: not covered
    assert _digests(views) == before


def test_exchanged_blocks_and_conv_sections_change_the_digest():
    config, caches, views = _hybrid()
    before = _digests(views)
    assert _digests(views, [[3, 9, 1, 7], *IDS[1:]]) != before  # blocks 1 <-> 3
    gdn = config.kv_cache_groups[1].layer_names[0]
    conv = caches.caches[gdn][0]  # (B, state, channels) SD
    q = conv[5, :, 0:64].clone()
    conv[5, :, 0:64] = conv[5, :, 64:128]
    conv[5, :, 64:128] = q
    assert _digests(views)[gdn] != before[gdn]


@pytest.mark.parametrize(("digests", "why"), [
    ((("nope", 1),), "'nope'"),
    ((("a", 1), ("a", 1)), "repeated"),
    ((("a", -1),), "64-bit"),
    ((("a", 1 << 64),), "64-bit"),
    ((("a", 1), ("b", 2), ("c", 3)), "3 integrity digests"),
])
def test_digests_a_rogue_prefill_sends_are_refused(digests, why):
    refusal = digest.mismatch(digests, {"a": 1, "b": 2}, {"a": 0, "b": 1})
    assert refusal is not None and why in refusal


def test_a_mismatch_names_the_group_and_layer_range_and_a_gap_is_unproven():
    expected = {"l0": 1, "l1": 2, "l2": 3, "s0": 4}
    groups = {"l0": 0, "l1": 0, "l2": 0, "s0": 1}
    assert digest.mismatch(tuple(expected.items()), expected, groups) is None
    wrong = digest.mismatch((("l0", 1), ("l1", 9), ("l2", 9), ("s0", 8)), expected, groups)
    assert wrong is not None
    assert "KV cache group 0: 2 layer(s) l1 .. l2" in wrong and "group 1" in wrong
    assert "unproven" in (digest.mismatch((("l0", 1),), expected, groups) or "")


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), [(4, 1, 8), (8, 1, 8), (8, 2, 8),
                                                     (1, 8, 8), (4, 1, 2), (2, 4, 2)])
def test_each_unit_is_written_by_exactly_one_prefill_rank(p_tp, d_tp, heads):
    for d in range(d_tp):
        assert digest.covers_receiver(p_tp, (d, d_tp), heads)
        assert digest.covers_receiver(p_tp, (d, d_tp), 1, replicated=True)


# -- sabotaged plans on real Schedulers ----------------------------------------------------

def _integrity_errors(d) -> list[str]:
    return [e for w in d.workers for *_, e in w.ledger.recent if "integrity" in e]


def _run(p, d, prompts):
    try:
        records = pd.run_pd(p, d, prompts=prompts)
        statuses = pd.finished_ids(d)
        # a hybrid's failed load is recomputed on decode on every build (vLLM's
        # invalid-block path reads one KV cache group): "length" with decode's own compute
        failed = ["recomputed" if statuses.get(r["d_req"]) == "length" and any(
            computed == 0 for computed, _ in d.scheduled_blocks.get(r["d_req"], ()))
            else statuses.get(r["d_req"]) for r in records.values()]
        errors = _integrity_errors(d)
        pd.assert_idle(p)
        pd.assert_idle(d)
        return failed, errors
    finally:
        p.shutdown()
        d.shutdown()


def _pair(model="hybrid", p_tp=1, d_tp=1, **kw):
    port = pd.free_port()
    # 96 blocks: a 17-block request of the hybrid takes 17 in each of its 4 groups
    return (pd.build_instance("kv_producer", p_tp, port, model=model, num_blocks=96),
            pd.build_instance("kv_consumer", d_tp, port + 9, model=model, seed=1,
                              num_blocks=96, **kw))


def _wrap_plan(monkeypatch, change):
    original = plans.PlanTable.plan

    def sabotaged(self, sender, receiver, *args):
        return change(original(self, [list(g) for g in sender], receiver, *args), sender)

    monkeypatch.setattr(plans.PlanTable, "plan", sabotaged)


def _token0_unmoved(plan, _sender):
    """Every descriptor run leaves its first 16 bytes behind."""
    keep = plan.length > 16
    sixteen = np.uint64(16)
    return plans.TransferPlan(plan.src[keep] + sixteen, plan.dst[keep] + sixteen,
                              plan.length[keep] - sixteen)


def _swap_conv_sections(monkeypatch):
    """Each block's conv Q and K destinations exchanged (equal sizes, inside the page)."""
    original = plans._section_segments

    def swapped(s, r, pair):
        out = original(s, r, pair)
        shift = {"conv_q": 1, "conv_k": -1}.get(s.name)
        if not shift:
            return out
        return [(src, dst + shift * r.units * r.unit_bytes, n) for src, dst, n in out]

    monkeypatch.setattr(plans, "_section_segments", swapped)


def _swap_sender_ranks(monkeypatch):
    """The planner pairs prefill rank 0 with rank 1's share and 1 with 0's."""
    original = plans._section_segments

    def swapped(s, r, pair):
        return original(s, r, plans.RankPair(1 - pair.sender_rank, pair.sender_tp,
                                             pair.receiver_rank, pair.receiver_tp))

    monkeypatch.setattr(plans, "_section_segments", swapped)


@hybrid_decode
@pytest.mark.parametrize("sabotage", ["token0", "conv", "ranks", "blocks13", "heads"])
def test_a_narrowly_wrong_plan_fails_the_request_naming_the_group(monkeypatch, sabotage):
    prompts, p_tp = [40], 1
    if sabotage == "token0":
        _wrap_plan(monkeypatch, _token0_unmoved)
    elif sabotage == "conv":
        _swap_conv_sections(monkeypatch)
    elif sabotage == "ranks":
        _swap_sender_ranks(monkeypatch)
        p_tp = 2
    elif sabotage == "heads":
        original = plans._section_segments

        def heads(s, r, pair):  # the two heads' destinations exchanged in K and V
            out = original(s, r, pair)
            if s.name not in ("k_heads", "v_heads") or len(out) != 1 \
                    or out[0][2] != 2 * s.unit_bytes:
                return out
            src, dst, _ = out[0]
            u = s.unit_bytes
            return [(src, dst + u, u), (src + u, dst, u)]

        monkeypatch.setattr(plans, "_section_segments", heads)
    else:  # the 2nd and 4th block of a 17-block request exchanged
        prompts = [17 * BLOCK - 2]
        original = plans.PlanTable.plan

        def blocks(self, sender, receiver, *args):
            sender = [list(g) for g in sender]
            if len(sender[0]) >= 4:
                sender[0][1], sender[0][3] = sender[0][3], sender[0][1]
            return original(self, sender, receiver, *args)

        monkeypatch.setattr(plans.PlanTable, "plan", blocks)
    p, d = _pair(p_tp=p_tp)
    failed, errors = _run(p, d, prompts)
    assert failed in (["error"], ["recomputed"]), (failed, errors)
    assert errors and "integrity digest differs" in errors[0] and "KV cache group" in errors[0]
    group = 0 if sabotage in ("token0", "blocks13", "heads") else 1
    assert f"KV cache group {group}" in errors[0], errors[0]


@hybrid_decode
def test_the_same_transfers_unsabotaged_pass_every_digest():
    """The control of the test above: the same shapes, plans intact, load and check."""
    for prompts, p_tp in (([40], 1), ([40], 2), ([17 * BLOCK - 2], 1)):
        p, d = _pair(p_tp=p_tp)
        failed, errors = _run(p, d, prompts)
        assert failed == ["length"] and not errors, (failed, errors)


def _count_byte_samples(monkeypatch) -> list[int]:
    from vllm_flagcx.connector.common import integrity

    calls: list[int] = []
    original = integrity.checksum

    def counted(ranges, *args):
        calls.append(len(ranges))
        return original(ranges, *args)

    monkeypatch.setattr(integrity, "checksum", counted)
    return calls


def test_a_reply_with_the_full_digest_carries_no_byte_sample(monkeypatch):
    """The digest covers every byte the sample would: neither side reads the sample
    (one integrity pass on the pull's path), and the load is proven by the digest."""
    samples = _count_byte_samples(monkeypatch)
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense")
    try:
        records = pd.run_pd(p, d, prompts=[30, 45])
        assert set(pd.finished_ids(d)) >= {r["d_req"] for r in records.values()}
        assert d.workers[0].ledger.counts == {}
        assert d.workers[0].stats["integrity_digest_layers"] > 0 and samples == []
    finally:
        p.shutdown()
        d.shutdown()


def test_without_the_digest_the_byte_sample_still_catches_a_silent_loss(monkeypatch):
    """Where no views exist (no digest is sent nor checked), the byte sample is the
    check: a transport that reports success and copied nothing fails the request."""
    from vllm_flagcx.connector import worker

    samples = _count_byte_samples(monkeypatch)
    original = worker.register
    monkeypatch.setattr(worker, "register", lambda *a: original(*a[:4], None))
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense",
                          faults=pd.Faults(silent_skip_from=0))
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense", seed=1)
    try:
        records = pd.run_pd(p, d, prompts=[30])
        assert set(pd.finished_ids(d)) >= {r["d_req"] for r in records.values()}
        assert d.workers[0].stats["integrity_failures"] == 1 and samples
        assert "did not land" in d.workers[0].ledger.recent[0][-1]
    finally:
        p.shutdown()
        d.shutdown()


def _run_tiles_on_the_host(tiles: np.ndarray, ids: np.ndarray, slots: int) -> list[int]:
    """What the CUDA digest kernel computes (``transport.cuda_kernel``), over host memory
    in numpy: a reference for the tiles ``digest_tiles`` builds from the views' strides
    (the kernel itself runs in tests/test_gpu_ipc.py on a GPU)."""
    import ctypes

    out = [0] * slots
    for t in tiles.reshape(-1, 14).tolist():
        base, block, token, row, word, per_block, blocks, at, rows, words, first, salt, \
            width, slot = t
        signed = [x - (1 << 64) if x >= 1 << 63 else x for x in (block, token, row, word)]
        block, token, row, word = signed
        total = 0
        for b in range(blocks):
            for s in range(per_block):
                for r in range(rows):
                    start = base + int(ids[at + b]) * block + s * token + r * row
                    raw = b"".join(ctypes.string_at(start + w * word, width)
                                   for w in range(words))
                    x = np.frombuffer(raw, f"<i{width}").astype(np.int64).view(np.uint64)
                    with np.errstate(over="ignore"):
                        acc = int((x * digest.weights(digest.WORD_SALT, words)).sum(
                            dtype=np.uint64))
                    total += acc * int(digest.weights(digest.TOKEN_SALT, 1, b * per_block + s)[0]) \
                        * int(digest.weights(salt, 1, first + r)[0])
        out[slot] = (out[slot] + total) & digest.MASK
    return out


@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_the_kernels_tiles_digest_what_the_views_hold(conv_layout):
    """The tiles the CUDA kernel is given (addresses and strides from vLLM's own views)
    cover the same elements, in the same logical coordinates, as the torch digest."""
    _, _, views = _hybrid(conv_layout)
    ids = [[3, 1], [5], [2], [11]]
    names, tiles, block_ids = kv_views.digest_tiles(views, ids, (0, 1), (0, 1), True)
    got = dict(zip(names, _run_tiles_on_the_host(tiles, block_ids, len(names)), strict=True))
    assert got == kv_views.layer_digests(views, ids, (0, 1), (0, 1), sending=True)
