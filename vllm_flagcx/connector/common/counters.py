"""What one worker counts (``Counters``: the ``vllm:flagcx_*`` counters of ``wire.metrics``)
and observes (``Observations``: its histograms and gauges) for vLLM's stats call.

One owner for them, shared by the side-channel server, the writers and the puller of a
worker, so every increment is taken under one lock (they run on different threads) and
vLLM's stats call takes the change since its previous call in one step (``take_delta``).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from vllm_flagcx.wire import metrics
from vllm_flagcx.wire.metrics import GAUGE_KEYS, Stat


def delta(now: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    """What changed since ``before``: a counter by how much (stats are sent to vLLM as
    deltas), a gauge (``wire.metrics.GAUGE_KEYS``) as its new level."""
    return {k: v if k in GAUGE_KEYS else v - before.get(k, 0) for k, v in now.items()
            if v != before.get(k, 0)}


class Counters:
    """Float counters keyed by ``Stat`` (every one an exported family); read back by its
    key string, and a key never counted reads as 0 (``get`` gives ``default``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}
        self._reported: dict[str, float] = {}

    def add(self, stat: Stat, amount: float = 1.0) -> float:
        """Count ``amount`` more of ``stat``; the new total."""
        with self._lock:
            total = self._values.get(stat.value, 0.0) + amount
            self._values[stat.value] = total
            return total

    def set(self, stat: Stat, value: float) -> None:
        """A level rather than a count (e.g. how many storages were registered)."""
        with self._lock:
            self._values[stat.value] = value

    def __getitem__(self, name: str) -> float:
        with self._lock:
            return self._values.get(name, 0.0)

    def get(self, name: str, default: float | None = None) -> float | None:
        with self._lock:
            return self._values.get(name, default)

    def take_delta(self) -> dict[str, float]:
        """What changed since the previous call."""
        with self._lock:
            changed = delta(self._values, self._reported)
            self._reported = dict(self._values)
        return changed


class Observations:
    """What one worker observed for the Prometheus histograms and gauges (``wire.metrics``),
    between two of vLLM's stats calls.

    Samples are kept per histogram key up to ``MAX_SAMPLES_PER_REPORT`` per step (a burst
    cannot grow memory without bound); the running count and sum per key (Prometheus'
    ``_count`` and ``_sum``, read by ``total``) take every observation. A gauge is
    reported while it is non-zero and once more when it drops to zero, so an idle engine
    sends nothing and a drained one does not keep showing its last busy value.

    Thread-safe: pull threads observe, the runner's step takes."""

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
