"""Writes run off the side-channel thread (real prefill worker, side channel and the
memmove stand-in transport with a slow write): while one write is under way, handshakes
are answered; a Release that arrives during the write is acknowledged only after it."""

from __future__ import annotations

import threading
import time

import pytest
import zmq
from testkit import pd_harness as pd
from testkit.transport_standin import Faults

from vllm_flagcx.wire import client
from vllm_flagcx.wire import handshake as hs

SLOW_WRITE = 2.0


def _ask(port: int, message: hs.Message, timeout: float = 10.0) -> hs.Message:
    return client.ask(zmq.Context.instance(), "127.0.0.1", port, message, timeout)


def _slow_pull_started(p: pd.Instance, d: pd.Instance, port: int) -> tuple[str, dict]:
    records = pd.run_prefill(p, [70])
    tid = next(iter(records))
    pd.step_prefill(p)
    groups = len(d.workers[0].sheet.layout.block_sizes)
    result: dict = {}

    def pull() -> None:
        result["reply"] = _ask(port, hs.PullRequest(tid, d.workers[0].sheet,
                                                    ((1, 2, 3, 4, 5),) * groups))
        result["at"] = time.monotonic()

    thread = threading.Thread(target=pull, daemon=True)
    thread.start()
    result["thread"] = thread
    deadline = time.monotonic() + 5
    while p.workers[0].sends.writes_in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.workers[0].sends.writes_in_flight == 1
    return tid, result


@pytest.fixture
def slow_pair():
    """A dense prefill whose every write takes SLOW_WRITE, its decode, and prefill's port."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense",
                          faults=Faults(delay_seconds=SLOW_WRITE))
    d = pd.build_instance("kv_consumer", 1, port + 5, seed=1, model="dense")
    try:
        yield p, d, port
    finally:
        p.shutdown()
        d.shutdown()


def test_a_slow_write_does_not_stall_the_side_channel(slow_pair):
    p, d, port = slow_pair
    _, pull = _slow_pull_started(p, d, port)
    answer = _ask(port, hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0))
    assert isinstance(answer, hs.HandshakeReply)
    assert p.workers[0].transport.write_done_at == []  # answered during the write
    pull["thread"].join(timeout=10)
    assert pull["reply"].ok and pull["reply"].num_bytes > 0


def test_release_during_a_write_is_acknowledged_only_after_the_write(slow_pair):
    p, d, port = slow_pair
    tid, pull = _slow_pull_started(p, d, port)
    ack = _ask(port, hs.Release(tid))
    acked_at = time.monotonic()
    assert isinstance(ack, hs.Ack)
    written = p.workers[0].transport.write_done_at
    assert len(written) == 1 and written[0] <= acked_at
    pull["thread"].join(timeout=10)
    assert pull["reply"].ok
    pd.step_prefill(p)
    assert p.scheduler.connector.scheduler.num_held == 0  # released, blocks freed


def test_a_pull_for_a_released_transfer_is_answered_at_once():
    """Decode TP 2: one rank fails and releases the transfer; the other rank's pull, if it
    comes after, used to wait out prefill's 30 s lease for an id that would never be
    armed again. Now it is answered at once, naming why."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense", lease_seconds=30.0)
    d = pd.build_instance("kv_consumer", 2, port + 5, seed=1, model="dense")
    try:
        records = pd.run_prefill(p, [70])
        tid = next(iter(records))
        pd.step_prefill(p)
        assert isinstance(_ask(port, hs.Release(tid)), hs.Ack)  # the failed rank's release
        groups = len(d.workers[1].sheet.layout.block_sizes)
        late = _ask(port, hs.PullRequest(tid, d.workers[1].sheet, ((1, 2, 3, 4, 5),) * groups),
                    timeout=5.0)
        assert isinstance(late, hs.PullReply) and not late.ok
        assert "released by decode" in late.error
        pd.step_prefill(p)
        assert not pd.busy(p)
    finally:
        p.shutdown()
        d.shutdown()


def _decode_block_of(d, address: int) -> int:
    """The decode block that holds ``address`` (in one of its registered regions)."""
    for region in d.workers[0].regions:
        offset = address - region.base
        if 0 <= offset < region.num_blocks * region.block_stride:
            return offset // region.block_stride
    raise AssertionError(f"{address:#x} is in no decode region")


def test_no_write_lands_after_decode_gave_its_blocks_back():
    """Writes that hang longer than decode's pull timeout plus prefill's lease, and more of
    them than prefill has writers (4 under way, 2 queued): decode used to give up once the
    Release went unacknowledged for a lease and hand the blocks back, and every write then
    landed late in blocks vLLM had reused (measured: 4 of 4 reused blocks changed). Now
    decode keeps the blocks until prefill confirms (``release_hold_seconds``), the queued
    writes of released transfers never start, and every failure is reported only after the
    last byte landed."""
    port = pd.free_port()
    hang = 2.5
    p = pd.build_instance("kv_producer", 1, port, model="dense", lease_seconds=0.4,
                          faults=Faults(delay_seconds=hang), num_blocks=64)
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense", recv_timeout=0.4,
                          lease_seconds=0.4, num_blocks=64)
    try:
        records = pd.run_pd(p, d, prompts=[33, 34, 35, 36, 37, 38], max_tokens=1)
        transport = p.workers[0].transport
        assert transport.writes == transport.max_concurrent_writes  # queued: never started
        failed_at = {rid: t for t, _, rid, _ in d.workers[0].ledger.recent}
        assert len(failed_at) == len(records) and len(transport.write_done_at) == 4
        for done, dst in zip(transport.write_done_at, transport.write_first_dst,
                             strict=True):
            block = _decode_block_of(d, dst)
            [rid] = [rid for rid, task in d.recv_tasks.items()
                     if block in task.block_ids[0]]
            assert failed_at[rid] >= done, f"{rid}'s blocks went back before its write"
        assert d.workers[0].stats["release_retries"] > 0  # held past one lease
        pd.assert_idle(p)
        pd.assert_idle(d)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_release_prefill_never_confirms_is_a_failed_notification():
    """A write hangs past decode's pull timeout and past ``release_hold_seconds``: decode
    gives the blocks back unconfirmed, fails the request and counts NIXL's
    ``num_failed_notifications`` (none before the request)."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense", lease_seconds=0.4,
                          faults=Faults(delay_seconds=2.5))
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense", recv_timeout=0.3,
                          lease_seconds=0.4, release_hold_seconds=0.6)
    try:
        assert d.workers[0].stats["num_failed_notifications"] == 0
        pd.run_pd(p, d, prompts=[33], max_tokens=1)
        [(_, stage, _, error)] = d.workers[0].ledger.recent
        assert stage == "recv" and "did not confirm" in error, error
        assert d.workers[0].stats["num_failed_notifications"] == 1
    finally:
        p.shutdown()
        d.shutdown()


def test_a_pull_parked_before_the_arm_is_written_at_the_arm_not_the_next_poll(monkeypatch):
    """The router's concurrent mode: decode asks before prefill finished, so its pull
    parks. The prefill step that arms the transfer wakes the side channel and the write
    starts then: with the server's idle poll set to a minute, the answer still comes
    within seconds (before, a parked pull waited for the next poll, 20 ms by default)."""
    from vllm_flagcx.connector.prefill import server

    monkeypatch.setattr(server, "POLL_SECONDS", 60.0)
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    d = pd.build_instance("kv_consumer", 1, port + 5, seed=1, model="dense")
    try:
        tid = next(iter(pd.run_prefill(p, [70])))
        assert len(p.workers[0].sends) == 0  # finished, not armed yet: the next step arms
        groups = len(d.workers[0].sheet.layout.block_sizes)
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(reply=_ask(
            port, hs.PullRequest(tid, d.workers[0].sheet, ((1, 2, 3, 4, 5),) * groups))),
            daemon=True)
        thread.start()
        deadline = time.monotonic() + 5
        while not len(p.workers[0].server.parked) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(p.workers[0].server.parked) == 1
        pd.step_prefill(p, steps=1)
        thread.join(timeout=10)
        assert result["reply"].ok, result["reply"]
    finally:
        p.shutdown()
        d.shutdown()
