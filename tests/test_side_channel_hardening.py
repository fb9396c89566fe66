"""No message can end prefill's side-channel server, and a pull's untrusted fields are
checked before any plan is made (real prefill worker and side channel over loopback,
real vLLM Scheduler); decode's scheduler survives ``kv_transfer_params`` that are not an
object."""

from __future__ import annotations

import time

import msgspec
import zmq
from testkit import pd_harness as pd
from testkit import vllm_harness as harness

from vllm_flagcx.connector import worker as wk
from vllm_flagcx.connector.prefill.pulls import ParkedPull, ParkedPulls
from vllm_flagcx.wire import client, endpoints
from vllm_flagcx.wire import handshake as hs


def _ask(port: int, message: hs.Message) -> hs.Message:
    return client.ask(zmq.Context.instance(), "127.0.0.1", port, message, 5.0)


def _handshake_answers(port: int) -> bool:
    return isinstance(_ask(port, hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0)),
                      hs.HandshakeReply)


def test_malformed_frames_and_bytes_never_end_the_server():
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port)
    try:
        assert _handshake_answers(port)
        dealer = zmq.Context.instance().socket(zmq.DEALER)  # no REQ envelope: 1 frame
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoints.address("127.0.0.1", port))
        dealer.send(b"x")
        dealer.send_multipart([b"a", b"b", b"c", b"d"])
        time.sleep(0.3)
        dealer.close()
        reply = _ask(port, hs.Release("x"))  # well-formed but a stranger's id
        assert isinstance(reply, hs.Ack)
        garbage = client.ask(zmq.Context.instance(), "127.0.0.1", port,
                             hs.Release("y"), 5.0)
        assert isinstance(garbage, hs.Ack)
        assert p.workers[0].stats["malformed_messages"] >= 2
        assert _handshake_answers(port)
    finally:
        p.shutdown()


def test_forged_pull_fields_are_refused_and_the_server_keeps_serving():
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    d = pd.build_instance("kv_consumer", 1, port + 5, seed=1, model="dense")
    try:
        records = pd.run_prefill(p, prompts=[37])
        rec = next(iter(records.values()))
        tid = rec["params"]["transfer_id"]
        good = p.workers[0].sheet
        groups = len(good.layout.block_sizes)
        forged = {
            "tp_size=0": msgspec.structs.replace(good, tp_size=0),
            "tp_rank=5 of 2": msgspec.structs.replace(good, tp_size=2, tp_rank=5),
        }
        for name, sheet in forged.items():
            reply = _ask(port, hs.PullRequest(tid, sheet, ((1,),) * groups))
            assert isinstance(reply, hs.PullReply) and not reply.ok, name
            assert "not a TP position" in reply.error, name
        wrong_groups = _ask(port, hs.PullRequest(tid, good, ((1,),) * (groups + 1)))
        assert not wrong_groups.ok and "block-id groups" in wrong_groups.error
        negative = _ask(port, hs.PullRequest(tid, good, ((-1,),) * groups))
        assert not negative.ok and "block id" in negative.error
        assert _handshake_answers(port)
        pd.run_decode(p, d, records)  # the transfer was untouched: its decode pulls it
        assert rec["d_req"] in pd.finished_ids(d)
        assert sum(sum(w.ledger.counts.values()) for w in d.workers) == 0
        assert d.workers[0].observations.total("bytes_transferred")[1] > 0
        assert not pd.busy(p) and not pd.busy(d)
    finally:
        p.shutdown()
        d.shutdown()


def _park_bare_pulls(port: int, sheet, ids) -> list:
    """REQ sockets whose pulls for never-armed transfer ids wait on prefill."""
    context = zmq.Context.instance()
    groups = len(sheet.layout.block_sizes)
    waiting = []
    for tid in ids:
        sock = context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoints.address("127.0.0.1", port))
        sock.send(hs.encode(hs.PullRequest(tid, sheet, ((1,),) * groups)))
        waiting.append(sock)
    time.sleep(0.3)
    return waiting


def test_pulls_for_unknown_ids_are_capped_and_never_block_an_armed_transfer():
    """Strangers fill the parking (cap 2 here); the third stranger is refused naming the
    cap, and the real decode's pull for an armed transfer still loads: the server claims
    before it parks (before, the cap was checked first and the real pull failed)."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, lease_seconds=30.0, model="dense")
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense")
    p.workers[0].server.parked = ParkedPulls(max_pulls=2)
    try:
        good = p.workers[0].sheet
        waiting = _park_bare_pulls(port, good, ["unknown-0", "unknown-1"])
        third = _ask(port, hs.PullRequest("unknown-3", good,
                                          ((1,),) * len(good.layout.block_sizes)))
        assert not third.ok and "pulls wait here" in third.error
        records = pd.run_pd(p, d, prompts=[40])
        assert next(iter(records.values()))["d_req"] in pd.finished_ids(d)
        assert sum(d.workers[0].ledger.counts.values()) == 0
        assert d.workers[0].observations.total("bytes_transferred")[1] > 0
        for sock in waiting:
            sock.close()
    finally:
        p.shutdown()
        d.shutdown()


def test_a_replayed_pull_takes_one_parking_slot():
    """One captured pull sent 20 times (cap 4): each replaces the one parked before it, so
    the parking never fills and a different pull still parks."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, lease_seconds=30.0, model="dense")
    p.workers[0].server.parked = ParkedPulls(max_pulls=4)
    try:
        good = p.workers[0].sheet
        waiting = _park_bare_pulls(port, good, ["replayed"] * 20)
        assert len(p.workers[0].server.parked) == 1
        waiting += _park_bare_pulls(port, good, ["another"])
        assert len(p.workers[0].server.parked) == 2
        assert p.workers[0].stats["pulls_refused_parking_full"] == 0
        for sock in waiting:
            sock.close()
    finally:
        p.shutdown()


_SHEET = hs.make_sheet(
    layout=hs.LayoutFacts(model="m", dtype="bfloat16", kv_cache_dtype="bfloat16",
                          group_kinds=("full_attention",), block_sizes=(16,),
                          kernel_block_sizes=(16,), page_bytes=(4096,), conv_layout="SD",
                          num_kv_heads=2, cache_format="CPU_ATTN:layout=HND"),
    engine_id="d", incarnation="i1", tp_size=1, tp_rank=0)


def _entry(tid: str, engine: str = "d", size: int = 100, armed: bool = False,
           rank: int = 0) -> ParkedPull:
    sheet = msgspec.structs.replace(_SHEET, engine_id=engine, tp_rank=rank)
    return ParkedPull(b"id-" + tid.encode(), hs.PullRequest(tid, sheet, ((1,),)), 0.0, size,
                      armed)


def test_parking_caps_count_bytes_and_engines_apart_from_armed_pulls():
    parked = ParkedPulls(max_pulls=3, max_bytes=250, max_per_engine=2, max_busy=1)
    assert parked.park(_entry("a", "e1")) == (None, None)
    assert parked.park(_entry("b", "e1")) == (None, None)
    refusal, _ = parked.park(_entry("c", "e1", size=10))
    assert refusal is not None and "engine 'e1'" in refusal
    refusal, _ = parked.park(_entry("c", "e2"))
    assert refusal is not None and "bytes" in refusal
    assert parked.park(_entry("c", "e2", size=50)) == (None, None)
    refusal, _ = parked.park(_entry("d", "e3", size=1))
    assert refusal is not None and "not armed yet" in refusal
    assert parked.park(_entry("armed", "e3", armed=True)) == (None, None)  # apart
    refusal, _ = parked.park(_entry("armed2", "e3", armed=True))
    assert refusal is not None and "writer" in refusal
    assert parked.park(_entry("a", "e1")) == (None, b"id-a")  # replaced, not added
    assert len(parked) == 4


def test_non_object_kv_transfer_params_are_ignored_not_a_crash():
    port = pd.free_port()
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense")
    try:
        for bad in (["do_remote_prefill"], "true", 7):
            req = harness.make_request(37, max_tokens=2, kv_transfer_params=bad)
            d.scheduler.add_request(req)
            deadline = time.monotonic() + 20
            while pd.busy(d) and time.monotonic() < deadline:
                d.step()
            assert req.request_id in pd.finished_ids(d), bad
        assert not pd.busy(d)
    finally:
        d.shutdown()


def test_an_unexpected_error_in_a_pull_thread_fails_the_request_not_strands_it(monkeypatch):
    """A pull thread that raised used to die silently: its request waited forever with
    its blocks. Now the error fails the request (recomputed) and prefill is released."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    d = pd.build_instance("kv_consumer", 1, port + 5, seed=1, model="dense")

    def broken(*_args, **_kwargs):
        raise RuntimeError("a bug nobody caught")

    try:
        records = pd.run_prefill(p, [37])
        monkeypatch.setattr(wk.hs, "check_compatible", broken)
        pd.run_decode(p, d, records)
        rec = next(iter(records.values()))
        assert rec["d_req"] in pd.finished_ids(d)
        assert d.workers[0].ledger.counts["recv"] == 1
        assert "a bug nobody caught" in d.workers[0].ledger.recent[-1][3]
        assert not pd.busy(p) and not pd.busy(d)
    finally:
        p.shutdown()
        d.shutdown()
