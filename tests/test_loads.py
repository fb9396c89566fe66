"""connector.loads: decode's load lifecycle as pure transitions (the scheduler half's use of
it runs on vLLM's real Scheduler in test_pd_*; these pin each rule alone)."""

from __future__ import annotations

import pytest

from vllm_flagcx.connector.decode.loads import LoadPhase, Loads, LoadStateError
from vllm_flagcx.wire.params import RemotePrefill, TransferId

REMOTE = RemotePrefill(TransferId("t1"), "127.0.0.1", 5600, 1, "prefill-0", (16,))
REQUEST = object()  # stands for vLLM's Request: the lifecycle only hands it back


def _remote(transfer_id: str) -> RemotePrefill:
    return RemotePrefill(TransferId(transfer_id), "127.0.0.1", 5600, 1, "prefill-0", (16,))


def _pulling(loads: Loads, request_id: str = "r1") -> None:
    loads.match(request_id, REQUEST, REMOTE, local_hit=32)
    assert loads.plan(request_id, REQUEST, REMOTE) == 32
    loads.dispatch([request_id])


def test_a_load_goes_matched_planned_pulling_landed_and_leaves_with_its_request():
    loads = Loads()
    loads.match("r1", REQUEST, REMOTE, local_hit=0)
    loads.match("r1", REQUEST, REMOTE, local_hit=16)  # asked again: the pool was full
    assert loads.phase("r1") is LoadPhase.MATCHED
    assert loads.plan("r1", REQUEST, REMOTE) == 16
    assert loads.phase("r1") is LoadPhase.PLANNED
    loads.dispatch(["r1", "someone-else"])
    assert loads.phase("r1") is LoadPhase.PULLING
    assert loads.land("r1") is False  # the request is still alive: it runs next
    assert loads.phase("r1") is LoadPhase.LANDED
    assert loads.end_request("r1") == (LoadPhase.LANDED, REMOTE)
    assert len(loads) == 0


def test_only_a_pulling_load_is_kept_past_its_request_and_leaves_when_its_load_ends():
    loads = Loads()
    _pulling(loads)
    assert loads.end_request("r1") == (LoadPhase.PULLING, REMOTE)
    assert loads.phase("r1") is LoadPhase.KEPT  # a pull may still write the blocks
    assert list(loads.holders(but="x")) == []  # but it no longer waits to run
    assert loads.land("r1") is True  # now vLLM may free them
    assert "r1" not in loads
    loads.match("r2", REQUEST, REMOTE, local_hit=0)
    loads.plan("r2", REQUEST, REMOTE)  # planned, never dispatched: nothing in flight
    assert loads.end_request("r2") == (LoadPhase.PLANNED, REMOTE)
    assert "r2" not in loads


def test_a_match_that_comes_to_nothing_is_dropped_and_a_replan_is_refused():
    loads = Loads()
    loads.match("r1", REQUEST, REMOTE, local_hit=64)
    loads.drop("r1")
    assert loads.phase("r1") is None
    _pulling(loads, "r2")
    with pytest.raises(LoadStateError, match="planned twice"):
        loads.plan("r2", REQUEST, REMOTE)
    with pytest.raises(LoadStateError, match="matched again while pulling"):
        loads.match("r2", REQUEST, REMOTE, local_hit=0)


def test_a_failure_is_taken_only_while_loading_and_yields_only_when_vllm_frees():
    loads = Loads()
    _pulling(loads, "r1")
    _pulling(loads, "r2")
    assert loads.fail("r1", vllm_frees=True, yields=5) is REQUEST
    assert loads.get("r1").yields_left == 5
    assert loads.fail("r2", vllm_frees=False, yields=5) is REQUEST
    assert loads.get("r2").failed and loads.get("r2").yields_left is None
    assert loads.fail("unknown", vllm_frees=True, yields=5) is None
    loads.land("r1")
    assert loads.fail("r1", vllm_frees=True, yields=5) is None  # landed: not loading
    assert {id(h) for h in loads.holders(but="r1")} == {id(loads.get("r2"))}


def test_the_kept_slot_no_longer_yields():
    loads = Loads()
    _pulling(loads)
    loads.fail("r1", vllm_frees=True, yields=3)
    loads.end_request("r1")
    assert loads.get("r1").yields_left is None


def test_the_heartbeat_reads_its_targets_from_the_loads_and_from_no_list_of_its_own():
    """Awaited = MATCHED: a request decode has and will pull, without blocks yet; planned,
    dropped and finished ones leave the heartbeat's round with no call to it."""
    from vllm_flagcx.wire.client import HeartbeatSender

    loads = Loads()
    beats = HeartbeatSender(30.0, loads.awaited)
    loads.match("a", REQUEST, _remote("t-a"), 0)
    loads.match("b", REQUEST, _remote("t-b"), 0)
    loads.match("c", REQUEST, _remote("t-c"), 0)
    assert {r.transfer_id for r in loads.awaited()} == {"t-a", "t-b", "t-c"}
    loads.plan("a", REQUEST, _remote("t-a"))
    loads.drop("b")
    assert [tid for ids in beats._targets().values() for tid in ids] == ["t-c"]
    loads.match("d", REQUEST, _remote("t-d"), 0)
    assert [tid for ids in beats._targets(fresh_only=True).values() for tid in ids] == [
        "t-d"]  # woken: only the new one is beaten at once
    loads.end_request("c")
    loads.end_request("d")
    assert loads.awaited() == [] and beats._targets() == {}
