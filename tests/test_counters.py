"""connector.counters: one owner for a worker's transfer counters, shared by its threads."""

from __future__ import annotations

import threading

from vllm_flagcx.connector.common.counters import Counters, delta
from vllm_flagcx.wire.metrics import Stat


def test_increments_from_many_threads_are_never_lost():
    counters = Counters()

    def count() -> None:
        for _ in range(5000):
            counters.add(Stat.SEND_BYTES, 2)

    threads = [threading.Thread(target=count) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counters["send_bytes"] == 8 * 5000 * 2


def test_add_returns_the_running_total_and_unknown_names_read_as_zero():
    counters = Counters()
    assert counters["refused_peers"] == 0
    assert counters.get("refused_peers") is None
    assert [counters.add(Stat.REFUSED_PEERS) for _ in range(3)] == [1, 2, 3]
    assert counters.get("refused_peers", 0) == 3


def test_take_delta_reports_each_change_once():
    counters = Counters()
    counters.add(Stat.SEND_BYTES, 100)
    counters.set(Stat.REGISTERED_STORAGES, 4)
    assert counters.take_delta() == {"send_bytes": 100, "registered_storages": 4}
    assert counters.take_delta() == {}
    counters.add(Stat.SEND_BYTES, 20)
    counters.add(Stat.EXPIRED_LEASES, 0)  # counted, unchanged: not reported
    assert counters.take_delta() == {"send_bytes": 20}


def test_delta_keeps_changed_keys_only():
    assert delta({"a": 3, "b": 1}, {"a": 1, "b": 1}) == {"a": 2}
    assert delta({"a": 1}, {}) == {"a": 1}
