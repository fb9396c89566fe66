"""Per-request timelines: where a PD request's time to first token goes.

Two processes write one line each per request, joined by the transfer id:

* the router (``side=router``): when the request came in, its prefill leg was sent and
  answered, its decode leg was sent, decode's headers and first body byte came back;
* decode's connector worker (``side=decode``): when its scheduler half planned the load,
  the pull started on a kept thread, the fact sheet was at hand, every prefill rank
  answered (with prefill's own queue, write and integrity-sample seconds inside that
  answer), the integrity check ended, and the step reported the load to vLLM.

**The clock rule, stated once**: every ``t_*`` field is ``time.monotonic()`` seconds
(CLOCK_MONOTONIC), which on Linux is one clock for every process of a host. Phases that
cross processes (router to decode) are computed only between lines of one host; the
router and decode of a cross-host deployment each still give their own phases. Durations
measured on prefill (``p_*``) are its own differences, never compared with decode's clock.

The lines are ``flagcx-timeline side=... key=value ...`` with values in seconds; written at
INFO when ``log_timelines`` is on (decode: ``kv_connector_extra_config.log_timelines``; our
router: ``--log-timelines``), else at DEBUG. ``breakdown`` turns a router line and a decode
line into the phases of one request, which sum to its router-measured time to first byte.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

MARK = "flagcx-timeline"

ROUTER_FIELDS = ("t_in", "t_prefill_sent", "t_prefill_done", "t_decode_sent", "t_headers",
                 "t_first_byte")
DECODE_FIELDS = ("t_planned", "t_started", "t_sheet", "t_answered", "t_verified",
                 "t_reported", "p_queued", "p_write", "p_sample")

# (phase, what it covers), in the order a request goes through them
PHASES: tuple[tuple[str, str], ...] = (
    ("router_in", "router: request in -> prefill leg sent"),
    ("prefill_leg", "prefill's HTTP leg: API, scheduling, the prompt's compute, answer"),
    ("router_between", "router: prefill's answer -> decode leg sent"),
    ("decode_to_plan", "decode's API and engine input -> its scheduler planned the load"),
    ("plan_to_pull", "the plan reaches the worker's step -> a kept thread starts the pull"),
    ("handshake", "prefill's fact sheet (cached after the first pull)"),
    ("side_channel", "pull request and reply on the wire (the answer minus prefill's work)"),
    ("prefill_queued", "prefill: the pull waited for its arm or a writer"),
    ("prefill_write", "prefill: the transport's writes"),
    ("prefill_sample", "prefill: the integrity sample and digest"),
    ("verify", "decode: integrity check of the reply"),
    ("report", "pull done -> the worker's next get_finished reports it to vLLM"),
    ("first_token", "decode's step with the last prompt token, its answer -> router"),
)

# (detail, the decode line's field, its phase, what it covers): parts of a phase, read
# where the line has them (older peers' lines lack them); not phases, so the phases still
# sum to the total; the table shows them under their phase
DETAILS: tuple[tuple[str, str, str, str], ...] = (
    ("prefill_sample.digest", "p_digest", "prefill_sample", "of which the full digest"),
    ("verify.bytes", "d_bytes_check", "verify", "of which the byte sample's check"),
    ("verify.digest", "d_digest", "verify", "of which the full digest and its comparison"),
)

# not a phase: when the router sent the client prefill's first token, decode's first byte
# above is the answer's second token, and this is the client's time to its first
SEEDED = "client_first_token"

_LINE = re.compile(rf"{MARK} side=(router|decode) transfer=(\S+)((?: \w+=\S+)*)")


class TimelineError(ValueError):
    """A timeline line that does not parse (a field missing or not a number)."""


def format_line(side: str, transfer_id: str, values: Mapping[str, float | str]) -> str:
    fields = " ".join(f"{k}={v:.6f}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in values.items())
    return f"{MARK} side={side} transfer={transfer_id} {fields}"


def parse_lines(text: str | Iterable[str]) -> dict[str, dict[str, dict[str, float]]]:
    """side -> transfer id -> its numeric fields, from log text (other lines ignored;
    a transfer logged twice keeps its last line)."""
    lines = text.splitlines() if isinstance(text, str) else text
    out: dict[str, dict[str, dict[str, float]]] = {"router": {}, "decode": {}}
    for line in lines:
        match = _LINE.search(line)
        if match is None:
            continue
        side, transfer, rest = match.groups()
        values: dict[str, float] = {}
        for pair in rest.split():
            key, _, raw = pair.partition("=")
            try:
                values[key] = float(raw)
            except ValueError:
                continue  # a text field (the request id)
        out[side][transfer] = values
    return out


def _need(values: Mapping[str, float], fields: tuple[str, ...], side: str) -> None:
    missing = [f for f in fields if f not in values]
    if missing:
        raise TimelineError(f"{side} timeline lacks {', '.join(missing)}")


def breakdown(router: Mapping[str, float], decode: Mapping[str, float]) -> dict[str, float]:
    """The phases (seconds) of one request from its two lines; they telescope, so their
    sum is the router's time to first byte (``total``). Both lines come from one host
    (the clock rule)."""
    _need(router, ROUTER_FIELDS, "router")
    _need(decode, DECODE_FIELDS, "decode")
    r, d = router, decode
    prefill_work = d["p_queued"] + d["p_write"] + d["p_sample"]
    phases = {
        "router_in": r["t_prefill_sent"] - r["t_in"],
        "prefill_leg": r["t_prefill_done"] - r["t_prefill_sent"],
        "router_between": r["t_decode_sent"] - r["t_prefill_done"],
        "decode_to_plan": d["t_planned"] - r["t_decode_sent"],
        "plan_to_pull": d["t_started"] - d["t_planned"],
        "handshake": d["t_sheet"] - d["t_started"],
        "side_channel": d["t_answered"] - d["t_sheet"] - prefill_work,
        "prefill_queued": d["p_queued"],
        "prefill_write": d["p_write"],
        "prefill_sample": d["p_sample"],
        "verify": d["t_verified"] - d["t_answered"],
        "report": d["t_reported"] - d["t_verified"],
        "first_token": r["t_first_byte"] - d["t_reported"],
    }
    phases["total"] = r["t_first_byte"] - r["t_in"]
    if "t_seed" in r:  # prefill's token went to the client first (router.first_token)
        phases[SEEDED] = r["t_seed"] - r["t_in"]
    return phases


def details(decode: Mapping[str, float]) -> dict[str, float]:
    """The ``DETAILS`` a decode line has (seconds)."""
    return {name: decode[field] for name, field, _, _ in DETAILS if field in decode}


def median_breakdown(text: str, since: float = 0.0) -> tuple[dict[str, float], int]:
    """(phase or detail -> median milliseconds over every request with both lines that
    came in at ``since`` or later on the router's clock, how many)."""
    lines = parse_lines(text)
    per_request = [{**breakdown(router, lines["decode"][tid]), **details(lines["decode"][tid])}
                   for tid, router in lines["router"].items()
                   if tid in lines["decode"] and router.get("t_in", 0.0) >= since]
    if not per_request:
        return {}, 0
    names = dict.fromkeys(k for p in per_request for k in p)
    return ({name: statistics.median(p[name] for p in per_request if name in p) * 1e3
             for name in names}, len(per_request))


def table(medians: Mapping[str, float], count: int) -> str:
    """The breakdown as text: one row per phase (median ms, share of the total, what it
    covers), then the total."""
    if not count:
        return "time to first byte by phase: no request had both timeline lines"
    total = medians.get("total", 0.0)
    rows = [f"time to first byte by phase, median over {count} request(s) (ms):"]
    for phase, what in PHASES:
        value = medians.get(phase, 0.0)
        share = f"{100 * value / total:5.1f} %" if total > 0 else "    -"
        rows.append(f"  {phase:<15} {value:9.3f}  {share}  {what}")
        rows += [f"    {name.partition('.')[2]:<13} {medians[name]:9.3f}           {part}"
                 for name, _, parent, part in DETAILS if parent == phase and name in medians]
    rows.append(f"  {'total':<15} {total:9.3f}  (medians of phases need not sum to it)")
    if SEEDED in medians:
        rows.append(f"  {SEEDED:<15} {medians[SEEDED]:9.3f}  the client's first token came "
                    "from prefill; the total above is decode's first (the 2nd token)")
    return "\n".join(rows)


# Prefill's durations come inside its reply, untrusted like the rest of it: a value that is
# not a finite number of seconds in [0, an hour] is dropped, never logged as if measured.
_MAX_SECONDS = 3600.0


@dataclass
class PullClock:
    """One pull's readings on decode, for its ``side=decode`` line."""

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
        return format_line("decode", self.transfer_id, {
            "request": request_id, "t_planned": self.planned, "t_started": self.started,
            "t_sheet": self.sheet, "t_answered": self.sheet + self.asking,
            "t_verified": self.verified, "t_reported": reported, "p_queued": self.p_queued,
            "p_write": self.p_write, "p_sample": self.p_sample, "p_digest": self.p_digest,
            "d_bytes_check": self.bytes_check, "d_digest": self.digest})
