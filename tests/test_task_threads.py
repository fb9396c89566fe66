"""Decode's kept pull threads (connector.task_threads): bounded, reused, never lost."""

from __future__ import annotations

import threading
import time

import pytest

from vllm_flagcx.connector.common.task_threads import TaskThreads


def _wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_sequential_tasks_reuse_one_thread():
    pool = TaskThreads(size=4)
    names = []
    try:
        for _ in range(20):
            done = threading.Event()
            pool.submit(lambda d=done: (names.append(threading.current_thread().name), d.set()))
            assert done.wait(5)
            time.sleep(0.002)  # the thread is back to waiting before the next task
        assert pool.started == 1
        assert len(set(names)) == 1
    finally:
        pool.shutdown()


def test_a_burst_runs_concurrently_up_to_the_bound_and_then_queues():
    pool = TaskThreads(size=3)
    gate = threading.Event()
    running = []
    lock = threading.Lock()
    peak = [0]

    def task():
        with lock:
            running.append(1)
            peak[0] = max(peak[0], len(running))
        gate.wait(5)
        with lock:
            running.pop()

    try:
        for _ in range(10):
            pool.submit(task)
        _wait(lambda: len(running) == 3)
        time.sleep(0.05)
        assert len(running) == 3 and pool.started == 3  # the bound holds; the rest wait
        gate.set()
        _wait(lambda: not running and pool._waiting == 0)
        assert peak[0] == 3
    finally:
        pool.shutdown()


def test_a_task_that_raises_keeps_its_thread_and_the_next_task_runs():
    pool = TaskThreads(size=1)
    done = threading.Event()
    try:
        pool.submit(lambda: 1 / 0)
        pool.submit(done.set)
        assert done.wait(5)
        assert pool.failures == 1 and pool.started == 1
    finally:
        pool.shutdown()


def test_shutdown_is_bounded_with_a_task_blocked_and_refuses_new_tasks():
    pool = TaskThreads(size=2)
    stuck = threading.Event()
    pool.submit(lambda: stuck.wait(30))
    started = time.monotonic()
    pool.shutdown(timeout=0.3)
    assert time.monotonic() - started < 2
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)
    stuck.set()


def test_size_must_be_positive():
    with pytest.raises(ValueError, match="size=0"):
        TaskThreads(size=0)
