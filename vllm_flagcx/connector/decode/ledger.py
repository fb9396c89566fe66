"""The failure ledger: every decode-side receive that failed, until vLLM is told.

Kept apart so its one rule is plain: the first failure of a request is the one reported,
counted per stage, and ``drain`` hands vLLM the failed requests and their blocks once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque

from vllm_flagcx.connector.common.counters import delta
from vllm_flagcx.connector.common.metadata import RequestId

logger = logging.getLogger("vllm_flagcx")

# Where a decode-side receive can fail. (Registration fails at startup, loudly; a failed
# prefill-side write reaches decode as a failed pull reply; both are counted in stats.)
STAGES = ("handshake", "recv")


class FailureLedger:
    """Failed requests with their blocks, by stage; drained once per engine step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failed: dict[RequestId, tuple[str, str, list[int]]] = {}
        self.counts: dict[str, int] = defaultdict(int)
        self.recent: deque[tuple[float, str, str, str]] = deque(maxlen=256)  # for operators
        self._last_counts: dict[str, int] = {}

    def record(self, stage: str, request_id: RequestId, block_ids: list[int], error: str) -> None:
        assert stage in STAGES, stage
        with self._lock:
            if request_id in self._failed:
                return  # the first failure is the one reported
            self._failed[request_id] = (stage, error, list(block_ids))
            self.counts[stage] += 1
            self.recent.append((time.monotonic(), stage, request_id, error))
        logger.warning("FlagCX %s failure for request %s: %s", stage, request_id, error)

    def take_counts(self) -> dict[str, float]:
        """Failures by stage since the previous call (for stats)."""
        with self._lock:
            changed = delta(self.counts, self._last_counts)
            self._last_counts = dict(self.counts)
        return changed

    def drain(self) -> tuple[set[RequestId], set[int]]:
        with self._lock:
            failed, self._failed = self._failed, {}
        return set(failed), {b for _, _, ids in failed.values() for b in ids}
