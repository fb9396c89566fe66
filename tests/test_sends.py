"""Prefill's transfer lifecycle (``connector.sends``) as pure transitions: arm, claim, finish,
release, expire, and the invariant that a Release is acknowledged only once no write into
the transfer's blocks is in flight (decode reuses the blocks once acknowledged)."""

from __future__ import annotations

from vllm_flagcx.connector.common.metadata import SendTask
from vllm_flagcx.connector.prefill import sends as S


def _armed(transfer_id="t1", request_id="r1", deadline=100.0, **kw):
    sends = S.Sends(**kw)
    assert sends.arm(SendTask(request_id, transfer_id, [[1, 2]], deadline))
    return sends


def test_a_release_during_a_write_is_acknowledged_only_after_it():
    sends = _armed()
    claim, send = sends.claim("t1", "decode-a")
    assert claim is S.Claim.WRITE
    assert sends.release("t1", b"releaser") is False  # deferred: the write is in flight
    assert sends.take_done() == set()  # blocks still held
    assert sends.finish("t1", send, rank=0, tp_size=2) == [b"releaser"]
    assert sends.take_done() == {"r1"}
    assert sends.claim("t1", "decode-a") == (S.Claim.ENDED, "released by decode")


def test_with_two_writes_the_release_waits_for_the_last():
    sends = _armed()
    _, first = sends.claim("t1", "decode-a")
    _, second = sends.claim("t1", "decode-a")
    assert sends.release("t1", b"r") is False
    assert sends.finish("t1", first, rank=0, tp_size=4) == []
    assert sends.take_done() == set()
    assert sends.finish("t1", second, rank=1, tp_size=4) == [b"r"]
    assert sends.take_done() == {"r1"}


def test_the_transfer_ends_when_every_receiver_rank_pulled():
    sends = _armed()
    for rank in (0, 1):
        claim, send = sends.claim("t1", "decode-a")
        assert claim is S.Claim.WRITE
        assert sends.finish("t1", send, rank=rank, tp_size=2) == []
        assert sends.take_done() == ({"r1"} if rank == 1 else set())
    assert sends.claim("t1", "decode-a")[1] == "already pulled by every receiver rank"
    assert sends.release("t1", b"late") is True  # nothing held: acknowledged at once


def test_a_lease_never_expires_under_a_write():
    sends = _armed(deadline=10.0)
    _, send = sends.claim("t1", "decode-a")
    assert sends.expire(now=50.0) == 0
    sends.finish("t1", send, rank=0, tp_size=2)
    assert sends.expire(now=50.0) == 1
    assert sends.take_done() == {"r1"}
    assert sends.claim("t1", "decode-a") == (S.Claim.ENDED, "its lease expired")


def test_heartbeats_push_the_lease():
    sends = _armed(deadline=10.0)
    assert sends.renew(["t1", "unknown"], until=60.0) == 1
    assert sends.renew(["t1"], until=30.0) == 0  # never shortened
    assert sends.expire(now=50.0) == 0


def test_a_heartbeat_before_the_transfer_is_armed_applies_when_it_is():
    """Decode's first word can beat the worker step that arms the transfer: it must not
    be lost, or the short first lease ends a transfer decode is about to pull."""
    sends = S.Sends()
    assert sends.renew(["t1"], until=60.0) == 0
    assert sends.arm(SendTask("r1", "t1", [[1]], deadline=10.0))
    assert sends.expire(now=50.0) == 0
    assert sends.expire(now=61.0) == 1
    for i in range(S.MAX_EARLY_RENEWALS + 5):  # bounded: a flood of unknown ids
        sends.renew([f"x{i}"], until=60.0)
    assert len(sends._early) == S.MAX_EARLY_RENEWALS


def test_claims_refuse_another_engine_wait_for_unknown_and_busy_writers():
    sends = _armed(max_writes=1)
    assert sends.claim("nope", "decode-a") == (S.Claim.WAIT, None)
    _, send = sends.claim("t1", "decode-a")
    assert sends.claim("t1", "decode-b")[0] is S.Claim.REFUSED
    assert sends.claim("t1", "decode-a") == (S.Claim.BUSY, None)
    sends.finish("t1", send, rank=0, tp_size=2)
    assert sends.claim("t1", "decode-a")[0] is S.Claim.WRITE


def test_a_second_request_under_an_armed_transfer_id_is_done_at_once():
    sends = _armed()
    assert not sends.arm(SendTask("r2", "t1", [[3]], 100.0))
    assert sends.take_done() == {"r2"}
    assert len(sends) == 1


def test_ended_ids_are_remembered_within_a_bound():
    sends = S.Sends()
    for i in range(S.MAX_ENDED_REMEMBERED + 10):
        sends.arm(SendTask(f"r{i}", f"t{i}", [[i]], 0.0))
    assert sends.expire(now=1.0) == S.MAX_ENDED_REMEMBERED + 10
    assert sends.claim("t0", "d") == (S.Claim.WAIT, None)  # forgotten: the oldest go
    assert sends.claim(f"t{S.MAX_ENDED_REMEMBERED + 9}", "d")[0] is S.Claim.ENDED
