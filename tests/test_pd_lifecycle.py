"""Full request lifecycle through the real schedulers of a P and a D instance.

P's caches are random bytes; after the transfer, every D block must equal the P block it
was paired with, byte for byte, for attention heads, conv channels and ssm heads sliced
per TP rank. Both schedulers must end empty: no request, no block in use.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from testkit import pd_harness as pd
from testkit import vllm_harness as harness

from vllm_flagcx.compat.probe import FEATURES_BY_KEY
from vllm_flagcx.wire.params import prefill_leg_params

pytestmark = pytest.mark.skipif(
    FEATURES_BY_KEY["hybrid_async_load"].probe() == "single_group",
    reason="this vLLM's scheduler cannot finish remote loads of hybrid requests; the "
           "connector refuses that role (tests/test_scheduler.py checks the refusal)")


def _ssm_global(inst, layer, block):
    return np.concatenate([c.caches[layer][1][block].contiguous().view(torch.uint8).numpy()
                           for c in inst.ranks])


def _conv_global(inst, layer, block, conv_layout):
    """Conv channels in global order [Q | K | V], gathered over the ranks."""
    parts = {"q": [], "k": [], "v": []}
    for caches in inst.ranks:
        conv = caches.caches[layer][0][block]
        conv = conv if conv_layout == "DS" else conv.t()  # (channels, width)
        q, k = pd.KEY_DIM // inst.tp, pd.KEY_DIM // inst.tp
        parts["q"].append(conv[:q])
        parts["k"].append(conv[q:q + k])
        parts["v"].append(conv[q + k:])
    return torch.cat([torch.cat(parts[x]) for x in "qkv"]).contiguous().view(torch.uint8).numpy()


def _check_bytes(p, d, records, conv_layout):
    layout = harness.HybridLayout()
    checked = 0
    for rec in records.values():
        send = next(t for t in p.send_tasks.values() if t.request_id == rec["p_req"])
        recv = d.recv_tasks[rec["d_req"]]
        p_attn, d_attn = send.block_ids[0], recv.block_ids[0]
        assert len(d_attn) == len(p_attn)
        for layer in layout.attention_layers:
            for pb, db in zip(p_attn, d_attn, strict=True):
                np.testing.assert_array_equal(pd.attention_block_bytes(d, layer, db),
                                              pd.attention_block_bytes(p, layer, pb))
                checked += 1
        for group in range(1, 4):
            pb, db = send.block_ids[group][-1], recv.block_ids[group][-1]
            for layer in layout.gdn_layers[group - 1::3]:
                np.testing.assert_array_equal(_ssm_global(d, layer, db),
                                              _ssm_global(p, layer, pb))
                np.testing.assert_array_equal(_conv_global(d, layer, db, conv_layout),
                                              _conv_global(p, layer, pb, conv_layout))
                checked += 1
    return checked


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (4, 2), (1, 2), (2, 4)])
@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_hybrid_pd_bytes_equal(p_tp, d_tp, conv_layout):
    port = pd.free_port()
    p = pd.build_instance("kv_producer", p_tp, port, conv_layout=conv_layout, seed=1)
    d = pd.build_instance("kv_consumer", d_tp, port + 5, conv_layout=conv_layout, seed=2)
    try:
        records = pd.run_pd(p, d, prompts=[37, 16, 70])
        assert all(r["params"] and r["params"]["remote_tp_size"] == p_tp
                   for r in records.values())
        assert _check_bytes(p, d, records, conv_layout) > 0
        finished = pd.finished_ids(d)
        assert {r["d_req"] for r in records.values()} <= set(finished)
        pd.assert_idle(p)
        pd.assert_idle(d)
        assert sum(w.stats["send_bytes"] for w in p.workers) > 0
        assert all(w.ledger.counts == {} for w in p.workers + d.workers)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_hybrid_on_the_triton_attention_layout_moves_the_same_bytes(conv_layout):
    """The H200 run's TRITON_ATTN hybrid case: attention (B, 2, N, H, D) with heads inside
    each token (NHD, whole blocks between equal TP sizes), GDN state in the same pages."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, conv_layout=conv_layout, seed=1,
                          attn_layout="triton_nhd")
    d = pd.build_instance("kv_consumer", 1, port + 5, conv_layout=conv_layout, seed=2,
                          attn_layout="triton_nhd")
    try:
        records = pd.run_pd(p, d, prompts=[37, 16, 70])
        assert _check_bytes(p, d, records, conv_layout) > 0
        pd.assert_idle(p)
        pd.assert_idle(d)
        assert all(w.ledger.counts == {} for w in p.workers + d.workers)
    finally:
        p.shutdown()
        d.shutdown()


def test_hybrid_triton_layout_with_other_tp_sizes_fails_by_name():
    """NHD heads cannot be split for another TP size: refused per request, never guessed."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 2, port, seed=1, attn_layout="triton_nhd")
    d = pd.build_instance("kv_consumer", 1, port + 5, seed=2, attn_layout="triton_nhd")
    try:
        pd.run_pd(p, d, prompts=[37])
        reasons = " ".join(str(k) for w in d.workers for k in w.ledger.counts)
        assert sum(sum(w.ledger.counts.values()) for w in d.workers) > 0, reasons
        pd.assert_idle(p)
        pd.assert_idle(d)
    finally:
        p.shutdown()
        d.shutdown()


def test_n_minus_one_rule_on_both_sides():
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port)
    d = pd.build_instance("kv_consumer", 1, port + 5)
    try:
        records = pd.run_pd(p, d, prompts=[33])
        rec = next(iter(records.values()))
        recv = d.recv_tasks[rec["d_req"]]
        assert recv.num_tokens == 32  # decode loads N-1 and recomputes the last token
        send = next(iter(p.send_tasks.values()))
        assert len(send.block_ids[0]) == 2  # prefill computed 32 tokens = 2 blocks
    finally:
        p.shutdown()
        d.shutdown()


# ---------------------------------------------------------------------- faults

FAULTS = {
    "write_fails": dict(p_faults=pd.Faults(fail_write_from=0)),
    "connect_fails": dict(p_faults=pd.Faults(fail_connect=True)),
    "prefill_unreachable": dict(d_port_shift=1, lease=2.0),  # only the lease can free P
    "lease_expired": dict(lease=0.3, d_delay=0.8),
    "incompatible_layout": dict(d_conv="DS"),
    # The transport says "done" but copied nothing (FlagCX can do that): the check catches it.
    "silent_slice_loss": dict(p_faults=pd.Faults(silent_skip_from=0)),
    # D waits 3 s for a write that takes 4 s; one request, so write and failure pair up.
    "reply_lost_in_time": dict(p_faults=pd.Faults(delay_seconds=4.0), prompts=(37,)),
}


def _run_fault(name, p_faults=None, d_port_shift=0, lease=30.0, d_delay=0.0, d_conv="SD",
               prompts=(37, 20)):
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, faults=p_faults, lease_seconds=lease)
    d = pd.build_instance("kv_consumer", 1, port + 5, conv_layout=d_conv, recv_timeout=3.0)
    try:
        if d_delay:
            records = pd.run_prefill(p, prompts=list(prompts))
            time.sleep(d_delay)
            pd.run_decode(p, d, records, remote_port_shift=d_port_shift)
        else:
            records = pd.run_pd(p, d, prompts=list(prompts), remote_port_shift=d_port_shift)
        return p, d, records
    except BaseException:
        p.shutdown()
        d.shutdown()
        raise


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_every_fault_ends_every_request(name):
    p, d, records = _run_fault(name, **FAULTS[name])
    try:
        finished = pd.finished_ids(d)
        assert {r["d_req"] for r in records.values()} <= set(finished), name
        pd.assert_idle(p)
        pd.assert_idle(d)
        failures = sum(sum(w.ledger.counts.values()) for w in d.workers)
        assert failures == len(records), (name, [w.ledger.counts for w in d.workers])
        if name == "reply_lost_in_time":  # failed only after P's late write had landed
            written = sorted(t for w in p.workers for t in w.transport.write_done_at)
            failed = sorted(t for w in d.workers for t, *_ in w.ledger.recent)
            assert len(written) == len(failed) == len(records)
            assert all(f >= w for f, w in zip(failed, written, strict=True))
        if name == "silent_slice_loss":
            assert sum(w.stats["integrity_failures"] for w in d.workers) == len(records)
        if name in ("lease_expired", "prefill_unreachable"):
            assert sum(w.stats["num_kv_expired_reqs"] for w in p.workers) == len(records)
        else:  # D told P, which freed the blocks at once
            assert sum(w.stats["num_kv_expired_reqs"] for w in p.workers) == 0
    finally:
        p.shutdown()
        d.shutdown()


def test_decode_abort_before_kv_releases_prefill_blocks():
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port)
    d = pd.build_instance("kv_consumer", 1, port + 5)
    try:
        records = pd.run_prefill(p, prompts=[40])
        assert p.scheduler.connector.scheduler.num_held == 1  # blocks held for decode
        assert harness.blocks_in_use(p.scheduler) > 0
        rec = next(iter(records.values()))
        req = harness.make_request(rec["tokens"], max_tokens=3,
                                   kv_transfer_params=dict(rec["params"]))
        d.scheduler.add_request(req)
        d.scheduler.finish_requests(req.request_id, pd.aborted())
        pd.settle(p, d, timeout=10)
        pd.assert_idle(p)
        pd.assert_idle(d)
        assert sum(w.stats["num_kv_expired_reqs"] for w in p.workers) == 0  # released, not expired
    finally:
        p.shutdown()
        d.shutdown()


def test_decode_abort_during_write_holds_blocks_until_no_write_in_flight():
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, faults=pd.Faults(delay_seconds=1.0))
    d = pd.build_instance("kv_consumer", 1, port + 5)
    try:
        records = pd.run_prefill(p, prompts=[40])
        rec = next(iter(records.values()))
        req = harness.make_request(rec["tokens"], max_tokens=3,
                                   kv_transfer_params=dict(rec["params"]))
        d.scheduler.add_request(req)
        deadline = time.monotonic() + 10
        while req.request_id not in d.recv_tasks and time.monotonic() < deadline:
            p.step()
            d.step()
        time.sleep(0.2)  # the pull reached P, whose (slow) write is under way
        d.scheduler.finish_requests(req.request_id, pd.aborted())
        d.step()
        assert harness.blocks_in_use(d.scheduler) > 0  # held: a write may still land
        pd.settle(p, d, timeout=10)
        pd.assert_idle(p)
        pd.assert_idle(d)
    finally:
        p.shutdown()
        d.shutdown()


def test_prefill_gone_after_prefill_fails_the_pull_at_once_not_after_the_timeouts():
    """P computes a prompt's KV, then its worker goes away (side channel, writer and all)
    before D pulls. D already holds P's fact sheet (an earlier request), so nothing but
    the pull itself notices: it must fail when P's port refuses connections, not after the
    pull timeout plus the release's wait for the lease (70 s in the e2e run)."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port)
    d = pd.build_instance("kv_consumer", 1, port + 5, recv_timeout=20.0)
    try:
        pd.run_pd(p, d, prompts=[37])  # D caches P's fact sheet
        rec = next(iter(pd.run_prefill(p, prompts=[40]).values()))
        p.shutdown()
        req = harness.make_request(rec["tokens"], max_tokens=3,
                                   kv_transfer_params=dict(rec["params"]))
        d.scheduler.add_request(req)
        started = time.monotonic()
        while pd.busy(d) and time.monotonic() < started + 15:
            d.step()
            time.sleep(0.002)
        elapsed = time.monotonic() - started
        assert req.request_id in pd.finished_ids(d)  # recomputed, not lost
        pd.assert_idle(d)
        [(_, stage, _, error)] = [e for w in d.workers for e in w.ledger.recent]
        assert stage == "recv" and "refuses connections" in error, error
        assert "did not confirm" not in error  # a gone writer writes nothing more
        assert elapsed < 10, elapsed  # the 1 s probe, not recv_timeout (20 s) + lease (30 s)
    finally:
        p.shutdown()
        d.shutdown()




def _seeded(i: int) -> dict:
    return prefill_leg_params(f"seeded-{i}-{time.monotonic_ns()}", seeded=True)


@pytest.mark.parametrize("n", [32, 33])  # the seed lands in a new block / inside one
def test_seeded_first_token_prefill_runs_every_token_and_decode_loads_them_all(n):
    """Router's first-token mode: prefill computes all N prompt tokens (no N-1 truncation:
    its sampled token is the true first token) and says so (``remote_num_tokens``);
    decode, given prompt + [t1], loads those N (state after N tokens included) and
    computes only t1. Same bytes on both sides."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 2, port, seed=1)
    d = pd.build_instance("kv_consumer", 1, port + 5, seed=2)
    try:
        records = pd.run_prefill(p, [n], prefill_params=_seeded)
        rec = next(iter(records.values()))
        assert rec["params"]["remote_num_tokens"] == n
        rec["tokens"] = n + 1  # prompt + [t1]
        pd.run_decode(p, d, records)
        send = next(iter(p.send_tasks.values()))
        assert len(send.block_ids[0]) == -(-n // 16)  # every prompt token's KV is held
        assert d.recv_tasks[rec["d_req"]].num_tokens == n
        assert _check_bytes(p, d, records, "SD") > 0
        assert rec["d_req"] in pd.finished_ids(d)
        pd.assert_idle(p)
        pd.assert_idle(d)
    finally:
        p.shutdown()
        d.shutdown()


def test_decode_refuses_state_after_another_token_count_and_computes_locally():
    """A seeded prefill holds the state after N tokens; a decode request of N tokens
    (not seeded: it would need the state after N-1) must not load it: it computes the
    prompt itself and prefill is told to free the blocks, nothing pulled."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, seed=1)
    d = pd.build_instance("kv_consumer", 1, port + 5, seed=2)
    try:
        records = pd.run_prefill(p, [33], prefill_params=_seeded)
        pd.run_decode(p, d, records)
        rec = next(iter(records.values()))
        assert rec["d_req"] not in d.recv_tasks
        assert rec["d_req"] in pd.finished_ids(d)
        assert sum(w.stats["send_bytes"] for w in p.workers) == 0
        pd.assert_idle(p)
        pd.assert_idle(d)
    finally:
        p.shutdown()
        d.shutdown()
