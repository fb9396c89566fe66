"""One pull's readings of the clock, for its ``wire.timeline`` line on decode.

Decode's readings are ``time.monotonic()`` (the clock rule in ``wire.timeline``); prefill's
come inside its reply as durations on its own clock, and are untrusted input like the rest
of the reply: a value that is not a finite number of seconds in [0, an hour] is dropped,
never logged as if measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_flagcx.wire import timeline

_MAX_SECONDS = 3600.0


@dataclass
class PullClock:
    transfer_id: str
    planned: float  # the scheduler half planned the load (RecvTask.planned_at)
    started: float  # a kept thread started the pull
    sheet: float = 0.0  # prefill's fact sheet at hand
    asking: float = 0.0  # seconds spent waiting for prefill ranks' answers, in all
    verified: float = 0.0  # every answer checked
    p_queued: float = 0.0
    p_write: float = 0.0
    p_sample: float = 0.0
    p_digest: float = 0.0  # of p_sample: the full logical digest (layout.digest)
    bytes_check: float = 0.0  # of the verification: checking the replies' byte samples
    digest: float = 0.0  # of the verification: this side's digests and their comparison
    prefill_timings_dropped: int = 0

    def add_prefill(self, timings: Sequence[float]) -> bool:
        """Add one prefill rank's (queued, write, sample[, of which the digest]) seconds; a
        prefill of the first protocol-2 releases sends three. False when they were
        dropped (not seconds)."""
        if len(timings) not in (3, 4) or not all(
                isinstance(t, float) and math.isfinite(t) and 0.0 <= t <= _MAX_SECONDS
                for t in timings):
            self.prefill_timings_dropped += 1
            return False
        self.p_queued += timings[0]
        self.p_write += timings[1]
        self.p_sample += timings[2]
        self.p_digest += timings[3] if len(timings) == 4 else 0.0
        return True

    def line(self, request_id: str, reported: float) -> str:
        return timeline.format_line("decode", self.transfer_id, {
            "request": request_id, "t_planned": self.planned, "t_started": self.started,
            "t_sheet": self.sheet, "t_answered": self.sheet + self.asking,
            "t_verified": self.verified, "t_reported": reported, "p_queued": self.p_queued,
            "p_write": self.p_write, "p_sample": self.p_sample, "p_digest": self.p_digest,
            "d_bytes_check": self.bytes_check, "d_digest": self.digest})
