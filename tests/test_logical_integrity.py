"""The logical integrity check: a transfer plan that names the wrong bytes fails the
request, through vLLM's own load-failure policy.

The byte sample (prefill checksums the tails of the descriptors it wrote, decode the
same destination ranges) compares a plan with itself, so a plan that sends head 0's bytes
to head 1's place passes it. The logical sample keys each element by what it means
(layer, block, token, KV head), read through each tensor's own indexing. These tests
break the plan on purpose (two heads' destinations swapped inside every block), run real
vLLM Schedulers with the connector's workers, and assert the request ends as vLLM's
``kv_load_failure_policy`` says: ``fail`` -> finished with an error, ``recompute`` ->
decode recomputes the prompt and finishes normally; a control with only the byte sample
shows the swap going unseen. The pure key selection and the refusal of keys a rogue
prefill could send are tested directly.
"""

from __future__ import annotations

import numpy as np
import pytest
from testkit import pd_harness as pd
from testkit.vllm_reads import failure_policy

from vllm_flagcx.layout import logical, plans
from vllm_flagcx.layout.logical import LayerFacts, LogicalKey

LAYERS = {"l0": LayerFacts(0, 16, 4), "l1": LayerFacts(0, 16, 4), "w": LayerFacts(1, 16, 4)}


def _pairs(blocks: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    s = np.arange(10, 10 + blocks)
    return [(s, s + 20), (s[-1:], s[-1:] + 20)]


def test_sample_covers_every_shared_head_and_tokens_past_the_first():
    keys = logical.sample_keys(LAYERS, _pairs(), range(1, 3))
    assert {k.layer for k, _ in keys} == set(LAYERS)
    for layer in LAYERS:
        mine = [k for k, _ in keys if k.layer == layer]
        assert {k.head for k in mine} == {1, 2}
        assert {k.token for k in mine} - {0}, "token 0 alone cannot see a one-token move"
    for key, sender in keys:  # every key pairs a receiver block with ITS sender block
        assert key.block == sender + 20


def test_sample_is_empty_without_shared_heads_or_blocks():
    assert logical.sample_keys(LAYERS, _pairs(), range(0)) == []
    empty = np.zeros(0, dtype=np.int64)
    assert logical.sample_keys({"l0": LAYERS["l0"]}, [(empty, empty)], range(2)) == []


@pytest.mark.parametrize(("key", "why"), [
    (LogicalKey("nope", 30, 0, 0), "layer 'nope'"),
    (LogicalKey("l0", 99, 0, 0), "block 99"),
    (LogicalKey("l0", 30, 16, 0), "token 16"),
    (LogicalKey("l0", 30, 0, 3), "KV head 3"),
])
def test_keys_a_rogue_prefill_sends_are_refused_before_any_read(key, why):
    refusal = logical.refuse_keys([key], LAYERS, [[30, 31], [32]], (0, 2))
    assert refusal is not None and why in refusal
    assert logical.refuse_keys([LogicalKey("l0", 31, 15, 1)], LAYERS, [[30, 31], [32]],
                               (0, 2)) is None


def test_more_keys_than_ever_sent_are_refused():
    keys = [LogicalKey("l0", 30, 0, 0)] * (logical.MAX_KEYS + 1)
    assert "at most" in (logical.refuse_keys(keys, LAYERS, [[30]], (0, 2)) or "")


def test_locate_maps_logical_tokens_to_kernel_blocks():
    assert logical.locate(3, 0, 1, 16) == (3, 0)
    assert logical.locate(3, 17, 2, 16) == (7, 1)


def _swap_two_heads(monkeypatch):
    """Every per-head segment run of two or more heads is split per head, and the first
    two heads' destinations are exchanged: the bytes still land inside the request's
    blocks, the byte sample of each descriptor still matches, the meaning is wrong."""
    original = plans._section_segments

    def swapped(s, r, pair):
        out = []
        for src, dst, length in original(s, r, pair):
            unit = s.unit_bytes
            if "nhd" in s.name or length < 2 * unit or length % unit:
                out.append((src, dst, length))
                continue
            heads = [(src + i * unit, dst + i * unit, unit) for i in range(length // unit)]
            heads[0], heads[1] = (heads[0][0], heads[1][1], unit), (heads[1][0],
                                                                   heads[0][1], unit)
            out += heads
        return out

    monkeypatch.setattr(plans, "_section_segments", swapped)


def _run_swapped(monkeypatch, policy: str | None, logical_check: bool):
    _swap_two_heads(monkeypatch)
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense", failure_policy=policy,
                          logical_check=logical_check)
    return p, d


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_plan_that_swaps_two_heads_fails_the_request_by_the_policy(monkeypatch, policy):
    from vllm_flagcx.compat.capabilities import capabilities

    if capabilities().kv_load_failure_policy_default == "absent":
        pytest.skip("this vLLM has no kv_load_failure_policy: its one behaviour is tested "
                    "by test_failed_recv_recovery")
    p, d = _run_swapped(monkeypatch, policy, logical_check=True)
    try:
        records = pd.run_pd(p, d, prompts=[40])
        assert failure_policy(d.scheduler.vllm_config.kv_transfer_config) == policy
        status = pd.finished_ids(d)[records[next(iter(records))]["d_req"]]
        assert status == ("error" if policy == "fail" else "length"), status
        stats = d.workers[0].stats
        assert stats["integrity_failures"] == 1 and stats["integrity_logical_keys"] > 0
        assert d.workers[0].ledger.counts["recv"] == 1
        if policy == "recompute":  # recomputed: every prompt token scheduled on decode
            assert d.scheduled_blocks[records[next(iter(records))]["d_req"]]
        pd.assert_idle(p)
        pd.assert_idle(d)
    finally:
        p.shutdown()
        d.shutdown()


def test_without_the_logical_sample_the_swap_goes_unseen(monkeypatch):
    """The control: the byte sample alone passes the broken plan, so the test above fails
    when the logical check is gone."""
    p, d = _run_swapped(monkeypatch, None, logical_check=False)
    try:
        records = pd.run_pd(p, d, prompts=[40])
        rec = next(iter(records.values()))
        assert pd.finished_ids(d)[rec["d_req"]] != "error"
        assert d.workers[0].stats["integrity_failures"] == 0
        assert d.workers[0].ledger.counts == {}
        with pytest.raises(AssertionError):  # decode holds other bytes than prefill
            pd.assert_attention_bytes_moved(p, d, records)
    finally:
        p.shutdown()
        d.shutdown()


def test_an_intact_transfer_checks_logical_keys_and_passes():
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 2, port, model="dense")
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense")
    try:
        records = pd.run_pd(p, d, prompts=[40, 23])
        assert set(pd.finished_ids(d)) >= {r["d_req"] for r in records.values()}
        assert d.workers[0].stats["integrity_logical_keys"] > 0
        assert d.workers[0].stats["integrity_failures"] == 0
        pd.assert_attention_bytes_moved(p, d, records)
    finally:
        p.shutdown()
        d.shutdown()
