"""The requests that production PD routers send, replayed against the real Scheduler.

llm-d's pd-sidecar (``connector_nixlv2.go``, its default), vllm-router's PD mode, vLLM's
toy proxy and SMG all speak the NIXL serial contract: the prefill leg carries
``kv_transfer_params`` with ``do_remote_decode: true`` and every ``remote_*`` field null
(no transfer id: the request id stands in), ``max_tokens=1``; the decode leg carries what
prefill returned, verbatim. NVIDIA Dynamo names only NixlConnector, MooncakeConnector and
MultiConnector: FlagCXConnector enters as MultiConnector's one child. The Mooncake-style
concurrent contract (router-minted id, bootstrap address) is refused by name.
"""

from __future__ import annotations

import time

import pytest
from testkit import pd_harness as pd
from testkit import vllm_harness as harness

from vllm_flagcx.wire import params as wire_params

NIXL_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False,
                "remote_engine_id": None, "remote_block_ids": None,
                "remote_host": None, "remote_port": None}


def _our_connector(instance):
    connector = instance.scheduler.connector
    children = getattr(connector, "_connectors", None)
    return children[0] if children else connector


@pytest.mark.parametrize("multi", [False, True], ids=["direct", "dynamo-multiconnector"])
def test_the_nixl_serial_contract_moves_the_kv(multi):
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense", multi=multi)
    d = pd.build_instance("kv_consumer", 1, pd.free_port(), model="dense", multi=multi)
    try:
        records = pd.run_prefill(p, [40, 70], prefill_params=lambda i: dict(NIXL_PREFILL))
        for tid, rec in records.items():
            returned = rec["params"]
            assert returned is not None, "max_tokens=1 must finish with params for decode"
            assert returned["transfer_id"] == tid == rec["p_req"]  # the request id
            # all decode needs is in the returned dict: it parses on its own
            remote = wire_params.parse_remote_prefill(returned)
            assert (remote.remote_host, remote.remote_port) == ("127.0.0.1", port)
        pd.run_decode(p, d, records)  # the params verbatim, as the routers send them
        pd.assert_attention_bytes_moved(p, d, records)
        pd.assert_idle(p)
        pd.assert_idle(d)
        assert _our_connector(d).scheduler.rejected_params == 0
    finally:
        p.shutdown()
        d.shutdown()


def test_a_retried_prefill_leg_leaks_nothing():
    """llm-d retries a prefill leg on 502/503/504: the first answer is lost, its KV is
    held with nobody to pull it. The short first lease frees it; the retry moves."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense",
                          extra={"first_lease_seconds": 0.5})
    d = pd.build_instance("kv_consumer", 1, pd.free_port(), model="dense")
    try:
        lost = pd.run_prefill(p, [40], prefill_params=lambda i: dict(NIXL_PREFILL))
        retried = pd.run_prefill(p, [40], prefill_params=lambda i: dict(NIXL_PREFILL))
        assert set(lost) != set(retried)  # request ids: unique per leg
        pd.run_decode(p, d, retried)
        pd.assert_attention_bytes_moved(p, d, retried)
        pd.settle(p, d, timeout=5)
        pd.assert_idle(p)  # the lost leg's blocks too, by the first lease
        assert sum(w.stats["num_kv_expired_reqs"] for w in p.workers) == 1
    finally:
        p.shutdown()
        d.shutdown()


def test_the_concurrent_contract_is_refused_by_name_and_computed_locally():
    params = {"do_remote_prefill": True, "transfer_id": "router-minted-1",
              "remote_bootstrap_addr": "10.0.0.5:8998", "remote_engine_id": "p0"}
    with pytest.raises(wire_params.TransferParamsError, match=r"remote_bootstrap_addr.*nixl"):
        wire_params.parse_remote_prefill(params)
    d = pd.build_instance("kv_consumer", 1, pd.free_port(), model="dense")
    try:
        req = harness.make_request(40, max_tokens=2, kv_transfer_params=dict(params))
        d.scheduler.add_request(req)
        for _ in range(20):
            d.step()
        assert pd.finished_ids(d).get(req.request_id) is not None  # computed, not stuck
        assert d.scheduler.connector.scheduler.rejected_params == 1
        told = [o.kv_transfer_params for step in d.outputs for eng in step.values()
                for o in eng.outputs if o.request_id == req.request_id and o.finish_reason]
        assert len(told) == 1 and "remote_bootstrap_addr" in told[0][
            wire_params.NOT_LOADED]  # the client sees why no KV moved
        assert req.kv_transfer_params == params  # read, never changed
    finally:
        d.shutdown()


def test_a_mooncake_prefill_leg_is_freed_at_once_and_names_the_mode():
    """vllm-router's Mooncake mode mints the transfer id for prefill (3 keys, no mark of
    ours); its decode leg will be refused, so prefill holds nothing (before: the KV stayed
    pinned for the first lease) and its answer names the mode and the fix. Our router's
    leg with a minted id is held as before (the control)."""
    mooncake = {"do_remote_decode": True, "do_remote_prefill": False,
                "transfer_id": "xfer-router-1"}
    p = pd.build_instance("kv_producer", 1, pd.free_port(), model="dense",
                          extra={"first_lease_seconds": 30.0})
    try:
        [rec] = pd.run_prefill(p, [40], prefill_params=lambda i: dict(mooncake)).values()
        assert "remote_host" not in rec["params"]  # nothing to pull
        assert "Mooncake" in rec["params"][wire_params.NOT_HELD]
        assert "--kv-connector nixl" in rec["params"][wire_params.NOT_HELD]
        for _ in range(3):
            p.step()
        pd.assert_idle(p)  # freed at once, not after the 30 s first lease
        assert p.scheduler.connector.scheduler.rejected_params == 1
        held = pd.run_prefill(p, [40], prefill_params=lambda i: wire_params.prefill_leg_params(
            "xfer-ours-1"))
        assert next(iter(held.values()))["params"]["remote_host"] == "127.0.0.1"
        assert p.scheduler.connector.scheduler.num_held == 1
    finally:
        p.shutdown()


def test_decode_reads_the_users_kv_transfer_params_and_never_changes_them():
    """Loaded or refused, the request's params are as the client sent them (before:
    decode wrote do_remote_prefill=False into them); a non-object is dropped (None), since
    vLLM's own scheduler would call ``.get`` on it."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    d = pd.build_instance("kv_consumer", 1, pd.free_port(), model="dense")
    try:
        records = pd.run_prefill(p, [40])
        pd.run_decode(p, d, records)
        pd.assert_attention_bytes_moved(p, d, records)
        rec = next(iter(records.values()))
        assert rec["d_request"].kv_transfer_params == rec["params"]
        assert rec["d_request"].kv_transfer_params["do_remote_prefill"] is True
        odd = harness.make_request(40, max_tokens=2, kv_transfer_params=["not", "a", "map"])
        d.scheduler.add_request(odd)
        for _ in range(20):
            d.step()
        assert pd.finished_ids(d).get(odd.request_id) is not None
        assert odd.kv_transfer_params is None  # the one write: vLLM 0.34 calls .get on it
        assert d.scheduler.connector.scheduler.rejected_params == 1  # warned once
    finally:
        p.shutdown()
        d.shutdown()


def test_a_loopback_address_is_named_when_the_handshake_fails():
    assert "side_channel_host" in wire_params.loopback_hint("127.0.0.1")
    assert "side_channel_host" in wire_params.loopback_hint("::1")
    assert wire_params.loopback_hint("10.1.2.3") == ""


def test_prefill_dp_ranks_each_advertise_their_port_and_may_share_a_request_id():
    """vLLM's API server pins a request to the DP rank named by ``X-data-parallel-rank``
    (llm-d and vllm-router send it); that rank's engine then answers the prefill leg. Each
    rank must name its own side channel (base port + rank x TP) in the dict it returns,
    and a router-minted ``X-Request-Id`` can reach two ranks (a prefill leg retried on the
    other rank): the NIXL contract makes that id the transfer id, so decode must tell the
    two pulls apart by their peer, and get each rank's own bytes."""
    base = pd.free_port()
    ranks = [pd.build_instance("kv_producer", 1, base, model="dense", seed=1 + r, dp_rank=r)
             for r in range(2)]
    d = pd.build_instance("kv_consumer", 1, pd.free_port(), model="dense")
    try:
        shared_id = "router-minted-uuid-7"
        records = [pd.run_prefill(p, [40], prefill_params=lambda i: dict(NIXL_PREFILL),
                                  request_id=lambda i: shared_id) for p in ranks]
        for r, rec in enumerate(records):
            params = rec[shared_id]["params"]
            assert params["transfer_id"] == shared_id
            assert params["remote_port"] == base + r  # TP 1: one port per rank
        for rec in records:  # both pulls in flight on one decode at once
            only = rec[shared_id]
            req = harness.make_request(only["tokens"], max_tokens=3,
                                          kv_transfer_params=dict(only["params"]))
            d.scheduler.add_request(req)
            only["d_req"] = req.request_id
        deadline = time.monotonic() + 60
        while any(map(pd.busy, (*ranks, d))) and time.monotonic() < deadline:
            for inst in (*ranks, d):
                inst.step()
            time.sleep(0.002)
        for p, rec in zip(ranks, records, strict=True):
            pd.assert_attention_bytes_moved(p, d, rec)
        layer = ranks[0].ranks[0].config.kv_cache_groups[0].layer_names[0]
        first, second = (pd.attention_block_bytes(p, layer, 1) for p in ranks)
        assert (first != second).any()  # the check above tells the ranks apart
        for inst in (*ranks, d):
            pd.assert_idle(inst)
    finally:
        for inst in (*ranks, d):
            inst.shutdown()
