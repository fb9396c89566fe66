"""The connector's own threads: decode's pulls and releases run on a few kept daemon
threads, not one new thread each (``TaskThreads``), and the transfers running on them are
counted so an idle engine step can wait for them (``InFlight``).

Why kept threads: a new thread per pull cost a thread start (and its stack) on the
critical path of every request, and a burst of requests started a burst of threads with no
bound. Why daemon threads, not ``concurrent.futures.ThreadPoolExecutor``: the executor's
threads are joined at interpreter exit, so a vLLM worker that exits during a pull would
wait for the pull's network timeout (up to ``recv_timeout``); a pull whose process is
going away has nobody to report to anyway. Why a bound: every pull holds a side-channel
connection and, on prefill, a writer; past the bound, tasks wait in order (the wait is
part of the request's ``queued`` phase, see ``connector.timeline``).

Why wait for what is in flight: while a request waits for its KV (decode) or for its pull
to be written (prefill), vLLM's engine loop runs empty steps back to back: Python that
holds the GIL most of the time. The connector's threads doing the transfer then get about
half of one core. B5 on an H100 measured the in-engine integrity sample at ~3x its time on
an idle process (1.0 vs 0.3 ms), and the finished load waited a further 0.5-2.5 ms for the
next step to report it. An empty step (the scheduler scheduled no token:
``FlagCXMetadataPayload.idle``) that sleeps in ``wait_idle`` until every transfer in flight
has ended gives those threads the interpreter, and reports a finished load in the step that
saw it finish. The wait is bounded (``idle_step_wait_seconds``), never happens in a step
that computes tokens, and returns at once when nothing is in flight."""

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


class InFlight:
    """A count of transfers begun and not ended, with a wait for it to reach zero."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running = 0

    def begin(self) -> None:
        with self._changed:
            self._running += 1

    def end(self) -> None:
        with self._changed:
            self._running = max(0, self._running - 1)
            if self._running == 0:
                self._changed.notify_all()

    @property
    def running(self) -> int:
        with self._changed:
            return self._running

    def wait_idle(self, timeout: float) -> float:
        """Block until nothing is in flight, at most ``timeout`` seconds (releasing the
        GIL meanwhile); the seconds waited (0.0 when nothing was in flight)."""
        with self._changed:
            if self._running == 0 or timeout <= 0:
                return 0.0
            started = time.monotonic()
            self._changed.wait_for(lambda: self._running == 0, timeout)
            return time.monotonic() - started
