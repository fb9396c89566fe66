"""The transfer counters of one worker (the ``vllm:flagcx_*`` counters of ``wire.metrics``).

One owner for them, shared by the side-channel server, the writers and the puller of a
worker, so every increment is taken under one lock (they run on different threads) and
vLLM's stats call takes the change since its previous call in one step (``take_delta``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

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
