"""The dense PD path in operation (one KV cache group, every build, 0.13 included): a failed
load through vLLM's own block-level policy, stats, heartbeats that keep prefill's lease,
cached prefill sheets, the integrity check, reconnects after a transport error, blocks of
a request that finished during its pull."""

from __future__ import annotations

import time

import numpy as np
import pytest
from testkit import pd_harness as pd
from testkit import vllm_harness as harness


def test_dense_load_failure_goes_through_vllm_policy():
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense",
                          faults=pd.Faults(fail_write_from=0))
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense")
    try:
        records = pd.run_pd(p, d, prompts=[40, 17])
        assert set(pd.finished_ids(d)) >= {r["d_req"] for r in records.values()}
        assert sum(w.ledger.counts["recv"] for w in d.workers) == 2
        pd.assert_idle(p)
        pd.assert_idle(d)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("end", ["abort", "load_failure_policy_fail"])
def test_a_request_finished_during_its_pull_gets_its_blocks_back_once_no_write_can_land(end):
    """Kept while prefill's (slow) write may land, then freed: by vLLM when
    ``finished_recving`` names the finished request (0.20+), by the connector on 0.13,
    whose scheduler only records the id (before: every abort during a pull, and every
    load failed under ``kv_load_failure_policy=fail``, leaked its blocks there)."""
    from vllm_flagcx.compat.capabilities import capabilities

    if end != "abort" and capabilities().kv_load_failure_policy_default == "absent":
        pytest.skip("this vLLM has no kv_load_failure_policy")
    port = pd.free_port()
    faults = (pd.Faults(delay_seconds=1.0) if end == "abort"
              else pd.Faults(fail_write_from=0))
    p = pd.build_instance("kv_producer", 1, port, model="dense", faults=faults)
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense",
                          failure_policy=None if end == "abort" else "fail")
    try:
        rec = next(iter(pd.run_prefill(p, prompts=[40]).values()))
        req = harness.make_request(rec["tokens"], max_tokens=3,
                                   kv_transfer_params=dict(rec["params"]))
        d.scheduler.add_request(req)
        if end == "abort":
            deadline = time.monotonic() + 10
            while req.request_id not in d.recv_tasks and time.monotonic() < deadline:
                p.step()
                d.step()
            time.sleep(0.2)  # the pull reached P, whose (slow) write is under way
            d.scheduler.finish_requests(req.request_id, pd.aborted())
            d.step()
            assert harness.blocks_in_use(d.scheduler) > 0  # held: a write may still land
            pd.settle(p, d, timeout=10)
        else:
            pd.settle(p, d, timeout=10)
            assert pd.finished_ids(d)[req.request_id] == "error"
        pd.assert_idle(p)
        pd.assert_idle(d)
        pd.run_pd(p, d, prompts=[20])  # the next transfer: no stale id stays behind
        assert req.request_id not in d.scheduler.finished_recving_kv_req_ids
    finally:
        p.shutdown()
        d.shutdown()


def test_stats_count_bytes_and_failures():
    from vllm_flagcx.compat.connector_api import SummedConnectorStats

    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense")
    try:
        pd.run_pd(p, d, prompts=[48])
        sent = p.workers[0].take_stats()
        assert sent["send_bytes"] == 3 * 2 * 2 * 16 * 2 * 64 * 2  # 3 blocks, 2 layers, K+V
        assert sent["send_descriptors"] >= 1
        assert p.workers[0].take_stats() == {}  # a delta: nothing new since
        merged = SummedConnectorStats(dict(sent)).aggregate(SummedConnectorStats(
            {"send_bytes": 1}))
        assert merged.reduce()["send_bytes"] == sent["send_bytes"] + 1
        received = d.workers[0].take_stats()
        # NIXL's semantics (wire.metrics): one sample per transfer (one prefill rank's
        # write) for the data movement, the rest of its wait, bytes and descriptors; the
        # request's whole wait separately
        assert received["bytes_transferred"] == [sent["send_bytes"]]
        assert received["num_descriptors"] == [sent["send_descriptors"]]
        (xfer,), (post,), (pull,) = (received[k] for k in ("xfer_time", "post_time",
                                                          "pull_seconds"))
        assert 0 < xfer <= sent["send_seconds"] + 1e-6  # prefill's write, as it timed it
        assert xfer + post <= pull  # both inside the request's wait
        assert d.workers[0].observations.total("bytes_transferred") == (1, sent["send_bytes"])
        assert len(received["handshake_seconds"]) == 1  # first contact with this prefill
        assert "pending_pulls" not in received  # never in flight at a report: not news
    finally:
        p.shutdown()
        d.shutdown()


def test_prefill_reports_what_it_holds_until_it_is_freed():
    """``pending_sends`` while prefill holds a request's KV for decode, 0 once when freed
    (here by the first lease), then nothing."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense",
                          extra={"first_lease_seconds": 0.3})
    try:
        pd.run_prefill(p, prompts=[40])
        p.step()  # the worker arms the transfer
        assert p.workers[0].take_stats()["pending_sends"] == 1
        started = time.monotonic()
        while p.scheduler.connector.scheduler.num_held and time.monotonic() - started < 5:
            p.step()
            time.sleep(0.05)
        report = p.workers[0].take_stats()
        assert report["pending_sends"] == 0 and report["num_kv_expired_reqs"] == 1
        assert "pending_sends" not in p.workers[0].take_stats()
    finally:
        p.shutdown()


def test_a_pull_after_the_lease_expired_counts_as_nixl_counts_it():
    """Prefill freed the KV by its lease; decode's late pull is refused, counted on
    prefill as a notification after expiry and on decode as a failed transfer (vLLM
    recomputes it); nothing is counted before the late pull."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense",
                          extra={"first_lease_seconds": 0.2})
    d = pd.build_instance("kv_consumer", 1, pd.free_port(), model="dense", via_entry=True)
    try:
        records = pd.run_prefill(p, prompts=[40])
        deadline = time.monotonic() + 5
        while p.scheduler.connector.scheduler.num_held and time.monotonic() < deadline:
            p.step()
            time.sleep(0.05)
        assert p.workers[0].stats["num_kv_expired_reqs"] == 1
        assert p.workers[0].stats["num_notifications_after_expiry"] == 0
        pd.run_decode(p, d, records)
        assert p.workers[0].stats["num_notifications_after_expiry"] >= 1  # pull, release
        assert d.entry is not None
        report = d.entry.connectors[0].get_kv_connector_stats()
        assert report is not None and report.data["num_failed_transfers"] == 1
        assert "bytes_transferred" not in report.data  # nothing moved, nothing observed
    finally:
        p.shutdown()
        d.shutdown()


def test_decode_heartbeats_keep_the_prefill_lease():
    from vllm_flagcx.wire.client import HeartbeatSender
    from vllm_flagcx.wire.params import parse_remote_prefill

    port = pd.free_port()
    p = pd.build_instance("kv_producer", 2, port, model="dense", lease_seconds=0.6)
    awaited: list = []  # stands in for decode's Loads: what it will pull
    beats = HeartbeatSender(0.15, lambda: list(awaited), timeout=0.5)
    try:
        records = pd.run_prefill(p, prompts=[40])
        rec = next(iter(records.values()))
        awaited.append(parse_remote_prefill(rec["params"]))
        beats.wake()
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            p.step()
            time.sleep(0.01)
        assert p.scheduler.connector.scheduler.num_held == 1  # still held: lease renewed
        assert harness.blocks_in_use(p.scheduler) > 0
        assert all(w.stats["lease_renewals"] > 0 for w in p.workers)  # on every P rank
        assert sum(w.stats["num_kv_expired_reqs"] for w in p.workers) == 0
        awaited.clear()
        deadline = time.monotonic() + 3
        while harness.blocks_in_use(p.scheduler) and time.monotonic() < deadline:
            p.step()
            time.sleep(0.01)
        assert harness.blocks_in_use(p.scheduler) == 0  # no heartbeat: the lease ends it
        assert all(w.stats["num_kv_expired_reqs"] == 1 for w in p.workers)
    finally:
        beats.stop()
        p.shutdown()


@pytest.mark.parametrize(("ttl", "handshakes"), [(300.0, 1), (0.0, 2)])
def test_cached_prefill_sheet_expires_by_ttl(ttl, handshakes):
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense", peer_ttl=ttl)
    try:
        pd.run_pd(p, d, prompts=[20])
        pd.run_pd(p, d, prompts=[24])
        assert p.workers[0].stats["handshakes_served"] == handshakes
        pd.assert_idle(p)
        pd.assert_idle(d)
    finally:
        p.shutdown()
        d.shutdown()


def test_integrity_check_can_be_turned_off():
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense",
                          faults=pd.Faults(silent_skip_from=0))
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense", seed=1,
                          verify_integrity=False)
    try:
        records = pd.run_pd(p, d, prompts=[30])
        assert set(pd.finished_ids(d)) >= {r["d_req"] for r in records.values()}
        assert d.workers[0].stats["integrity_failures"] == 0  # off: the loss goes unseen
        assert d.workers[0].ledger.counts == {}
        pd.assert_idle(p)
        pd.assert_idle(d)
    finally:
        p.shutdown()
        d.shutdown()


def test_integrity_sample_spreads_over_descriptor_tails():
    from vllm_flagcx.connector.common import integrity

    buf = np.arange(4096, dtype=np.uint8)
    base = buf.ctypes.data
    src = base + np.arange(0, 4096, 128, dtype=np.uint64)
    length = np.full(src.size, 100, dtype=np.uint64)
    s, d = integrity.sample_ranges(src, src + np.uint64(1), length, max_samples=4,
                                   sample_bytes=16)
    assert len(s) == 4 and all(n == 16 for _, n in s)
    assert s[0] == (base + 100 - 16, 16) and s[-1] == (int(src[-1]) + 100 - 16, 16)
    assert [a + 1 for a, _ in s] == [a for a, _ in d]
    before = integrity.checksum(s)
    buf[100 - 1] ^= 0xFF  # a byte inside the first sample
    assert integrity.checksum(s) != before


def test_transport_error_evicts_the_connection_and_the_next_request_reconnects():
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense",
                          faults=pd.Faults(fail_write_at=frozenset({0})))
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense")
    try:
        pd.run_pd(p, d, prompts=[30])  # write 0 fails: connection dropped
        pd.run_pd(p, d, prompts=[31])  # reconnects, succeeds
        transport = p.workers[0].transport
        assert transport.writes == 2 and transport.connects == 2
        assert d.workers[0].ledger.counts["recv"] == 1
        assert d.workers[0].observations.total("pull_seconds")[0] == 1
        pd.assert_idle(p)
        pd.assert_idle(d)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_decode_leg_that_never_arrives_frees_prefill_after_the_first_lease():
    """An external router's decode leg failed before decode's engine saw it: no Release
    comes, so prefill frees the blocks at the short first lease, not the full one. A decode
    that has the request says so at once (its first heartbeat: vLLM's ``on_new_request``
    where the build has it, else its first scheduling), which keeps the blocks held."""
    from vllm_flagcx.wire.client import HeartbeatSender
    from vllm_flagcx.wire.params import parse_remote_prefill

    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense", lease_seconds=30.0,
                          extra={"first_lease_seconds": 0.5})
    awaited: list = []
    beats = HeartbeatSender(30.0, lambda: list(awaited), timeout=0.5)  # no periodic round
    try:
        records = pd.run_prefill(p, prompts=[40, 40])
        abandoned, arrived = (rec for rec in records.values())
        awaited.append(parse_remote_prefill(arrived["params"]))
        beats.wake()  # beaten at once
        started = time.monotonic()
        while p.scheduler.connector.scheduler.num_held > 1 and time.monotonic() - started < 5:
            p.step()
            time.sleep(0.01)
        assert p.scheduler.connector.scheduler.num_held == 1  # the abandoned one, freed
        assert time.monotonic() - started < 3  # the first lease, not the 30 s one
        assert beats.sent >= 1 and p.workers[0].stats["lease_renewals"] == 1
        assert p.workers[0].stats["num_kv_expired_reqs"] == 1
        time.sleep(0.6)  # past the first lease: the one decode has stays held
        p.step()
        assert p.scheduler.connector.scheduler.num_held == 1
        assert harness.blocks_in_use(p.scheduler) > 0
        del abandoned
    finally:
        beats.stop()
        p.shutdown()


def test_decode_tells_prefill_on_arrival_where_vllm_says_a_request_arrived():
    """vLLM 0.22+ calls ``on_new_request`` when a request enters the engine: a decode
    request's heartbeat goes out then, before vLLM schedules it."""
    from vllm_flagcx.compat.capabilities import capabilities

    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense",
                          extra={"first_lease_seconds": 0.5})
    d = pd.build_instance("kv_consumer", 1, pd.free_port(), model="dense")
    try:
        records = pd.run_prefill(p, prompts=[40])
        rec = next(iter(records.values()))
        req = harness.make_request(40, max_tokens=3, kv_transfer_params=dict(rec["params"]))
        d.scheduler.add_request(req)  # not scheduled: no step runs on decode
        beats = d.scheduler.connector.scheduler.heartbeats
        deadline = time.monotonic() + 3
        arrival_hook = capabilities().new_request_hook == "native"
        while arrival_hook and not beats.sent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (beats.sent >= 1) == arrival_hook
        if arrival_hook:
            time.sleep(0.6)
            p.step()
            assert p.scheduler.connector.scheduler.num_held == 1  # kept: decode has it
    finally:
        p.shutdown()
        d.shutdown()
