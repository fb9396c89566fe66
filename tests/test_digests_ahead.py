"""Prefill's digests started at arm (``connector.common.integrity.DigestsAhead``), before decode's
pull asks: the rule that carries one pull's pairing to the next transfer (pure), then real
vLLM Schedulers with the connector's workers: after a first pull taught the pairing, the
next transfer's digest is taken on the background thread and decode's check passes; a
corrupted early digest must fail the load (so the early digest is what the reply
carries); a pairing that was not foreseen digests its own.
"""

from __future__ import annotations

import threading
from concurrent import futures
from concurrent.futures import Future

import pytest
from test_full_digest import _pair, _run, hybrid_decode

from vllm_flagcx.connector.common.integrity import MAX_PAIRINGS, DigestsAhead, Pairing

AHEAD_THREAD = "flagcx-digest-ahead"


def test_a_pulls_pairing_carries_to_a_transfer_of_another_length():
    every = Pairing.of((0, 1), [[1, 2, 3]], [[7, 8, 9]], [None])
    assert every.rules == (Pairing.ALL,)
    assert every.paired([[4, 5, 6, 10, 11]]) == ((4, 5, 6, 10, 11),)
    # a sliding window or a state: the last blocks only, however long the prompt
    window = Pairing.of((1, 2), [[1, 2, 3, 4], [5]], [[8, 9], [6]], [None, None])
    assert window.paired([[1, 2, 3, 4, 5, 6], [7]]) == ((5, 6), (7,))
    # decode held the first block: the rest, from the same offset
    cut = Pairing.of((0, 1), [[1, 2, 3]], [[8, 9]], [1])
    assert cut.rules == (("cut", 1, 0),)
    assert cut.paired([[4, 5, 6, 7]]) == ((5, 6, 7),)
    assert cut.paired([[]]) is None  # fewer blocks than the cut: nothing foreseen
    assert every.paired([[1], [2]]) is None  # another group count


def test_the_pairings_of_tp_1_to_8_are_all_kept_and_a_ninth_evicts_the_oldest():
    """TP 1 -> 8: each prefill rank is pulled by 8 decode ranks, each its own pairing."""
    ahead = DigestsAhead(None, None)  # type: ignore[arg-type]
    peers = [Pairing((rank, 8), (Pairing.ALL,)) for rank in range(MAX_PAIRINGS)]
    for pairing in peers:
        ahead.learn(pairing)
    ahead.learn(peers[0])  # seen again: the newest now
    assert ahead.pairings == [*peers[1:], peers[0]]
    ahead.learn(Pairing((0, 1), (Pairing.ALL,)))
    assert len(ahead.pairings) == MAX_PAIRINGS and peers[1] not in ahead.pairings


def test_a_pull_takes_a_running_digest_and_leaves_a_queued_one():
    """A burst of arms queues digests on the one thread: a pull whose digest has not
    started digests its own (faster than queueing) and the queued one is dropped."""
    early: dict = {}
    key = ((0, 1), ((1,),))
    queued: Future = Future()
    early[key] = queued
    assert DigestsAhead.take(early, key) is None and queued.cancelled()
    running: Future = Future()
    running.set_running_or_notify_cancel()
    running.set_result((("0-3", 7),))
    early[key] = running
    assert DigestsAhead.take(early, key) == (("0-3", 7),)
    assert DigestsAhead.take(early, key) is None  # taken once


def _threads_that_digest(monkeypatch, corrupt_ahead: bool = False) -> list[str]:
    """The thread of every digest taken, in order. Each transfer's early digests are
    finished before decode pulls (as when decode's pull comes 5-10 ms after the arm)."""
    names: list[str] = []
    original, original_start = DigestsAhead.digest, DigestsAhead.start

    def recorded(self, paired, peer):
        name = threading.current_thread().name
        names.append(name)
        got = original(self, paired, peer)
        if corrupt_ahead and name.startswith(AHEAD_THREAD) and got:
            (layers, value), *rest = got
            got = ((layers, value ^ 1), *rest)
        return got

    def start_and_finish(self, block_ids, into):
        original_start(self, block_ids, into)
        futures.wait(list(into.values()), timeout=30)

    monkeypatch.setattr(DigestsAhead, "digest", recorded)
    monkeypatch.setattr(DigestsAhead, "start", start_and_finish)
    return names


@hybrid_decode
@pytest.mark.parametrize("d_tp", [1, 2])
def test_after_one_pull_the_next_transfers_digest_is_taken_at_arm(monkeypatch, d_tp):
    names = _threads_that_digest(monkeypatch)
    p, d = _pair(d_tp=d_tp)
    failed, errors = _run_twice(p, d)
    assert failed == ["length", "length"] and not errors, (failed, errors)
    first, second = names[:d_tp], names[d_tp:]
    # the first transfer: no pairing known yet, each pull digests on its writer thread
    assert not any(n.startswith(AHEAD_THREAD) for n in first), names
    # the second: one digest per decode rank, each started at arm, none at the pull
    assert len(second) == d_tp and all(n.startswith(AHEAD_THREAD) for n in second), names


@hybrid_decode
def test_a_corrupted_early_digest_fails_the_load(monkeypatch):
    """The negative control: the reply carries the early digest, and decode checks it."""
    _threads_that_digest(monkeypatch, corrupt_ahead=True)
    p, d = _pair()
    failed, errors = _run_twice(p, d)
    assert failed[0] == "length" and failed[1] in ("error", "recomputed"), failed
    assert errors and "integrity digest differs" in errors[0], errors


@hybrid_decode
def test_a_pairing_not_foreseen_digests_its_own(monkeypatch):
    names = _threads_that_digest(monkeypatch)
    # every transfer's foreseen pairing names other blocks than its pull pairs
    monkeypatch.setattr(Pairing, "paired", lambda self, ids: tuple(
        tuple(reversed(g)) for g in ids))
    p, d = _pair()
    failed, errors = _run_twice(p, d)
    assert failed == ["length", "length"] and not errors, (failed, errors)
    ahead = [n for n in names if n.startswith(AHEAD_THREAD)]
    assert len(ahead) == 1 and len(names) == 3, names  # started, unused, then its own


def _run_twice(p, d):
    """Two transfers one after the other on one pair: the first pull teaches the
    pairing, the second transfer (more blocks) is armed after it. Decode's finish
    reasons of both, and the integrity errors."""
    from testkit import pd_harness as pd

    first = pd.run_pd(p, d, prompts=[40])
    failed, errors = _run(p, d, [3 * 16 + 5])
    statuses = pd.finished_ids(d)
    return [statuses.get(r["d_req"]) for r in first.values()] + failed, errors
