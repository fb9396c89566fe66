"""What one worker observed for the Prometheus histograms and gauges (``wire.metrics``),
between two of vLLM's stats calls.

Samples are kept per histogram key up to ``MAX_SAMPLES_PER_REPORT`` per step (a burst
cannot grow memory without bound); the running count and sum per key (Prometheus'
``_count`` and ``_sum``, read by ``total``) take every observation. A gauge is
reported while it is non-zero and once more when it drops to zero, so an idle engine
sends nothing and a drained one does not keep showing its last busy value.

Thread-safe: pull threads observe, the runner's step takes.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from vllm_flagcx.wire import metrics


class Observations:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: dict[str, list[float]] = defaultdict(list)
        self._totals: dict[str, tuple[int, float]] = {}
        self._reported_nonzero: set[str] = set()
        self._pulls_in_flight = 0

    def observe(self, key: str, value: float) -> None:
        if key not in metrics.HISTOGRAM_KEYS:
            raise KeyError(f"{key!r} is not a histogram of wire.metrics.FAMILIES")
        with self._lock:
            count, total = self._totals.get(key, (0, 0.0))
            self._totals[key] = (count + 1, total + value)
            samples = self._samples[key]
            if len(samples) < metrics.MAX_SAMPLES_PER_REPORT:
                samples.append(float(value))

    def total(self, key: str) -> tuple[int, float]:
        """(observations, their sum) of histogram ``key`` since the worker started."""
        with self._lock:
            return self._totals.get(key, (0, 0.0))

    def pull_started(self) -> None:
        with self._lock:
            self._pulls_in_flight += 1

    def pull_ended(self) -> None:
        with self._lock:
            self._pulls_in_flight -= 1

    def take(self, pending_sends: int) -> dict[str, Any]:
        """The samples since the last call and the gauges worth reporting now."""
        with self._lock:
            report: dict[str, Any] = {k: v for k, v in self._samples.items() if v}
            self._samples = defaultdict(list)
            gauges = {"pending_sends": pending_sends, "pending_pulls": self._pulls_in_flight}
            for key, value in gauges.items():
                if value or key in self._reported_nonzero:
                    report[key] = value
                if value:
                    self._reported_nonzero.add(key)
                else:
                    self._reported_nonzero.discard(key)
        return report
