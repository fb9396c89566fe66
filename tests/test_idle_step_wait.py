"""An engine step that computes no token waits for the transfers in flight
(``connector.common.task_threads.InFlight``): the wait itself, the flag the real
Scheduler's output sets, a load reported in the very step that planned it, a prefill step
that waits out a write, and the setting that turns it off."""

from __future__ import annotations

import threading
import time

import pytest
from testkit import pd_harness as pd
from testkit import vllm_harness as harness
from testkit.transport_standin import Faults

from vllm_flagcx.connector.common.settings import ConnectorSettings, SettingsError
from vllm_flagcx.connector.common.task_threads import InFlight


def test_nothing_in_flight_returns_at_once():
    assert InFlight().wait_idle(5.0) == 0.0


def test_the_wait_ends_when_the_last_transfer_ends():
    flight = InFlight()
    flight.begin()
    flight.begin()
    timers = [threading.Timer(0.05, flight.end), threading.Timer(0.15, flight.end)]
    for t in timers:
        t.start()
    waited = flight.wait_idle(5.0)
    assert 0.1 <= waited < 2.0 and flight.running == 0


def test_the_wait_is_bounded():
    flight = InFlight()
    flight.begin()
    started = time.monotonic()
    assert 0.05 <= flight.wait_idle(0.05) < 1.0
    assert time.monotonic() - started < 1.0 and flight.running == 1
    assert flight.wait_idle(0) == 0.0  # off


@pytest.mark.parametrize("value", [-1, "soon", float("nan"), True])
def test_a_bad_wait_setting_names_the_key(value):
    with pytest.raises(SettingsError, match="idle_step_wait_seconds"):
        ConnectorSettings.from_extra({"idle_step_wait_seconds": value})


def test_zero_turns_the_wait_off():
    assert ConnectorSettings.from_extra({"idle_step_wait_seconds": 0}).idle_step_wait_seconds \
        == 0.0


def _pair(p_wait: float, d_wait: float, p_faults: Faults | None = None):
    p = pd.build_instance("kv_producer", 1, pd.free_port(), model="dense", via_entry=True,
                          faults=p_faults, extra={"idle_step_wait_seconds": p_wait})
    d = pd.build_instance("kv_consumer", 1, pd.free_port(), model="dense", via_entry=True,
                          extra={"idle_step_wait_seconds": d_wait})
    return p, d


def _to_decode(p, d, records) -> str:
    pd.step_prefill(p, 2)  # prefill arms the finished request's send
    (rec,) = records.values()
    req = harness.make_request(rec["tokens"], max_tokens=2, kv_transfer_params=rec["params"])
    d.scheduler.add_request(req)
    return req.request_id


def test_a_load_is_reported_in_the_empty_step_that_planned_it():
    """Decode's first step schedules no token (its one request waits for KV): the worker
    waits for the pull there and reports it, so the next step already computes it."""
    p, d = _pair(p_wait=0.0, d_wait=5.0)
    try:
        rid = _to_decode(p, d, pd.run_prefill(p, [40]))
        d.step()
        assert d.workers[0].stats.get("idle_step_waits", 0) == 1
        assert d.workers[0].in_flight.running == 0
        d.step()
        assert rid in d.scheduled_blocks  # computed in step 2: the load came in step 1
        pd.settle(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_step_that_computes_tokens_never_waits_and_zero_never_waits():
    """Decode with the wait off: the load still arrives (reported by a later step), and
    no step waited. Prefill's steps that computed its prompt did not wait either."""
    p, d = _pair(p_wait=5.0, d_wait=0.0)
    try:
        records = pd.run_prefill(p, [40])
        assert p.workers[0].stats.get("idle_step_waits", 0) == 0  # no transfer yet
        rid = _to_decode(p, d, records)
        pd.settle(p, d)
        assert rid in d.scheduled_blocks
        assert d.workers[0].stats.get("idle_step_waits", 0) == 0
        assert d.workers[0].observations.total("pull_seconds")[0] == 1
    finally:
        p.shutdown()
        d.shutdown()


def test_an_empty_prefill_step_waits_out_a_write_in_flight():
    """Prefill holds only the finished request (its steps compute nothing) while decode's
    pull is written (the stand-in's write takes 1 s): the next prefill step waits for it.

    The test waits for the write to begin with short sleeps, not by stepping prefill back
    to back: a loop of empty steps holds the GIL, and on a 2-core CI machine it starved
    decode's pull thread for more than 10 s."""
    p, d = _pair(p_wait=5.0, d_wait=0.0, p_faults=Faults(delay_seconds=1.0))
    try:
        rid = _to_decode(p, d, pd.run_prefill(p, [40]))
        d.step()  # decode plans the load; its pull goes to prefill's side channel
        deadline = time.monotonic() + 20
        while not p.workers[0].in_flight.running and time.monotonic() < deadline:
            time.sleep(0.002)
        assert p.workers[0].in_flight.running == 1, "decode's pull never reached prefill"
        assert p.workers[0].stats.get("idle_step_waits", 0) == 0
        started = time.monotonic()
        p.step()
        assert time.monotonic() - started > 0.2  # it waited out the 1 s write (knob applied)
        assert p.workers[0].stats.get("idle_step_waits", 0) == 1
        assert p.workers[0].in_flight.running == 0  # that step returned after the write
        pd.settle(p, d)
        assert rid in d.scheduled_blocks
    finally:
        p.shutdown()
        d.shutdown()


def test_shutdown_keeps_the_port_open_until_the_write_in_flight_ended():
    """A graceful prefill shutdown during a write: the port must keep accepting
    connections (decode reads a refused port as "no write in flight" and frees its
    blocks) until the write ended; the old shutdown closed it first and the write landed
    in blocks vLLM had already reused."""
    import threading

    from vllm_flagcx.wire import endpoints

    p, d = _pair(p_wait=0.0, d_wait=0.0, p_faults=Faults(delay_seconds=1.5))
    try:
        _to_decode(p, d, pd.run_prefill(p, [40]))
        d.step()
        deadline = time.monotonic() + 20
        while not p.workers[0].in_flight.running and time.monotonic() < deadline:
            time.sleep(0.002)
        assert p.workers[0].in_flight.running == 1, "decode's pull never reached prefill"
        port = p.workers[0].server.port
        stopper = threading.Thread(target=p.workers[0].server.shutdown)
        stopper.start()
        time.sleep(0.5)  # shutdown has begun; the write has ~1 s left
        assert p.workers[0].in_flight.running == 1
        assert endpoints.listening("127.0.0.1", port)  # still listening: write in flight
        stopper.join(10)
        assert not stopper.is_alive()
        assert p.workers[0].in_flight.running == 0  # it returned after the write ended
        assert p.workers[0].transport.write_done_at  # the write completed before the close
    finally:
        p.shutdown()
        d.shutdown()
