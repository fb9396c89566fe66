"""The transfers running on the connector's own threads right now, so that an engine step
with nothing to compute can wait for them instead of spinning.

Why: while a request waits for its KV (decode) or for its pull to be written (prefill),
vLLM's engine loop runs empty steps back to back: Python that holds the GIL most of the
time. The connector's threads doing the transfer then get about half of one core. B5 on
an H100 measured the in-engine integrity sample at ~3x its time on an idle process (1.0
vs 0.3 ms), and the finished load waited a further 0.5-2.5 ms for the next step to report
it. An empty step (the scheduler scheduled no token: ``FlagCXMetadataPayload.idle``) that
sleeps in ``wait_idle`` until every transfer in flight has ended gives those threads the
interpreter, and reports a finished load in the step that saw it finish. The wait is
bounded (``idle_step_wait_seconds``), never happens in a step that computes tokens, and
returns at once when nothing is in flight.
"""

from __future__ import annotations

import threading
import time


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
