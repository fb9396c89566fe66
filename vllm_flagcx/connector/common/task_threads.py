"""Decode's pulls and releases run on a few kept daemon threads, not one new thread each.

Why kept threads: a new thread per pull cost a thread start (and its stack) on the
critical path of every request, and a burst of requests started a burst of threads with no
bound. Why daemon threads, not ``concurrent.futures.ThreadPoolExecutor``: the executor's
threads are joined at interpreter exit, so a vLLM worker that exits during a pull would
wait for the pull's network timeout (up to ``recv_timeout``); a pull whose process is
going away has nobody to report to anyway. Why a bound: every pull holds a side-channel
connection and, on prefill, a writer; past the bound, tasks wait in order (the wait is
part of the request's ``queued`` phase, see ``connector.timeline``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm_flagcx.connector.common.host_cpus import unpin_this_thread

DEFAULT_THREADS = 16


class TaskThreads:
    """Runs submitted calls on at most ``size`` daemon threads, started on demand and kept.

    A call that raises does not end its thread (callers guard their own failures; this is
    the last line, so one bad task never shrinks the pool)."""

    def __init__(self, size: int = DEFAULT_THREADS, name: str = "flagcx-pull") -> None:
        if size < 1:
            raise ValueError(f"TaskThreads size={size}: must be at least 1")
        self._size = size
        self._name = name
        self._tasks: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue())
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads blocked waiting for a task
        self._waiting = 0  # tasks submitted and not yet taken by a thread
        self._closed = False
        self.failures = 0  # calls that raised past their own guard

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("TaskThreads: submit after shutdown")
            self._tasks.put((fn, args))
            self._waiting += 1
            if self._waiting > self._idle and len(self._threads) < self._size:
                thread = threading.Thread(target=self._run, daemon=True,
                                          name=f"{self._name}-{len(self._threads)}")
                self._threads.append(thread)
                thread.start()

    @property
    def started(self) -> int:
        """Threads started so far (never more than ``size``)."""
        with self._lock:
            return len(self._threads)

    def _run(self) -> None:
        unpin_this_thread()
        while True:
            with self._lock:
                self._idle += 1
            item = self._tasks.get()
            with self._lock:
                self._idle -= 1
                if item is not None:
                    self._waiting -= 1
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception:
                with self._lock:
                    self.failures += 1

    def shutdown(self, timeout: float = 2.0) -> None:
        """Stop taking tasks; tasks still queued are dropped with the threads, which are
        waited for up to ``timeout`` in all (a pull blocked on the network is left to its
        own timeout: its thread is a daemon)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._tasks.put(None)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
