"""The hybrid and dense PD flows through the real entry class (vLLM's worker-role calls), a
registration failure at startup, and prefill and decode in two processes over the
same-host transport."""

from __future__ import annotations

import time

import numpy as np
import pytest
from testkit import pd_harness as pd
from testkit import vllm_harness as harness

from vllm_flagcx.compat.probe import FEATURES_BY_KEY

pytestmark = pytest.mark.skipif(
    FEATURES_BY_KEY["hybrid_async_load"].probe() == "single_group",
    reason="this vLLM's scheduler cannot finish remote loads of hybrid requests; the "
           "connector refuses that role (tests/test_scheduler.py checks the refusal)")


@pytest.mark.parametrize("transport", [None, "local"], ids=["standin", "local"])
@pytest.mark.parametrize("model", ["hybrid", "dense"])
def test_through_the_entry_class_worker_role(model, transport):
    """FlagCXConnector's own worker role (register_kv_caches, start_load_kv, get_finished /
    get_transfer_results, worker meta) driven in the model runner's order, over the
    stand-in and over the product's same-host transport (process_vm_writev)."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model=model, via_entry=True,
                          transport=transport)
    d = pd.build_instance("kv_consumer", 1, port + 5, model=model, via_entry=True,
                          transport=transport)
    try:
        records = pd.run_pd(p, d, prompts=[37, 19])
        assert set(pd.finished_ids(d)) >= {r["d_req"] for r in records.values()}
        for rec in records.values():
            send = next(t for t in p.send_tasks.values() if t.request_id == rec["p_req"])
            recv = d.recv_tasks[rec["d_req"]]
            layer = p.ranks[0].config.kv_cache_groups[0].layer_names[0]
            for pb, db in zip(send.block_ids[0], recv.block_ids[0], strict=True):
                np.testing.assert_array_equal(pd.attention_block_bytes(d, layer, db),
                                              pd.attention_block_bytes(p, layer, pb))
        pd.assert_idle(p)
        pd.assert_idle(d)
        stats = p.entry.connectors[0].get_kv_connector_stats()
        assert stats is not None and stats.reduce()["send_bytes"] > 0
    finally:
        p.shutdown()
        d.shutdown()


def test_registration_failure_is_a_clear_startup_error():
    from vllm_flagcx.transport.base import TransportError

    with pytest.raises(TransportError, match=r"register\(0x[0-9a-f]+, \d+\) refused"):
        pd.build_instance("kv_producer", 1, pd.free_port(), faults=pd.Faults(fail_register=True))


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_prefill_and_decode_in_two_processes_over_the_local_transport(model):
    """P and D as separate processes: the same-host transport writes across them."""
    import multiprocessing as mp

    port = pd.free_port()
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=pd.prefill_process,
                       args=(child, port, model, [37, 18], "local"), daemon=True)
    proc.start()
    d = None
    try:
        assert conn.poll(180), "prefill process did not start"
        records = conn.recv()
        d = pd.build_instance("kv_consumer", 1, port + 5, model=model, via_entry=True,
                              transport="local")
        for rec in records.values():
            req = harness.make_request(rec["tokens"], max_tokens=3,
                                       kv_transfer_params=dict(rec["params"]))
            d.scheduler.add_request(req)
            rec["d_req"] = req.request_id
        deadline = time.monotonic() + 60
        while pd.busy(d) and time.monotonic() < deadline:
            d.step()
            time.sleep(0.002)
        conn.send("stop")
        assert conn.poll(60)
        sent, p_busy = conn.recv()
        assert not p_busy  # prefill freed everything after the pulls
        pd.assert_idle(d)
        assert set(pd.finished_ids(d)) >= {r["d_req"] for r in records.values()}
        for rec in records.values():
            recv = d.recv_tasks[rec["d_req"]]
            for layer, blocks in sent[rec["p_req"]].items():
                got = [pd.attention_block_bytes(d, layer, b).tobytes()
                       for b in recv.block_ids[0]]
                assert got == blocks
    finally:
        if d is not None:
            d.shutdown()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
