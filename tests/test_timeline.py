"""Per-request timelines (wire.timeline): the line contract, the breakdown's arithmetic,
prefill's untrusted timings, and the lines the real parts write: decode's connector on the
real vLLM Scheduler, and the real router in front of stand-in upstreams."""

from __future__ import annotations

import logging
import math

import httpx
import pytest
from testkit import router_standin as rs
from testkit.router_standin import BODY, router

from vllm_flagcx.wire import timeline
from vllm_flagcx.wire.timeline import PullClock

ROUTER = {"t_in": 10.0, "t_prefill_sent": 10.001, "t_prefill_done": 10.030,
          "t_decode_sent": 10.031, "t_headers": 10.040, "t_first_byte": 10.060}
DECODE = {"t_planned": 10.035, "t_started": 10.036, "t_sheet": 10.0362, "t_answered": 10.041,
          "t_verified": 10.042, "t_reported": 10.045, "p_queued": 0.0005, "p_write": 0.002,
          "p_sample": 0.0003}


def test_a_line_round_trips_and_other_log_lines_are_ignored():
    line = timeline.format_line("decode", "flagcx-abc", {"request": "cmpl-1", **DECODE})
    parsed = timeline.parse_lines(f"INFO something else\n2026 {line}\nnoise")
    assert set(parsed["decode"]) == {"flagcx-abc"} and parsed["router"] == {}
    got = parsed["decode"]["flagcx-abc"]
    assert "request" not in got  # text fields are not numbers
    assert all(math.isclose(got[k], v, abs_tol=1e-6) for k, v in DECODE.items())


def test_the_phases_telescope_to_the_router_time_to_first_byte():
    phases = timeline.breakdown(ROUTER, DECODE)
    total = phases.pop("total")
    assert list(phases) == [name for name, _ in timeline.PHASES]
    assert math.isclose(sum(phases.values()), total, abs_tol=1e-9)
    assert math.isclose(total, 0.060, abs_tol=1e-9)
    assert math.isclose(phases["side_channel"], 0.0048 - 0.0028, abs_tol=1e-9)
    assert math.isclose(phases["first_token"], 0.015, abs_tol=1e-9)


def test_a_missing_field_is_named():
    broken = {k: v for k, v in DECODE.items() if k != "t_sheet"}
    with pytest.raises(timeline.TimelineError, match="decode timeline lacks t_sheet"):
        timeline.breakdown(ROUTER, broken)


def test_median_breakdown_joins_by_transfer_id():
    text = "\n".join([
        timeline.format_line("router", "a", ROUTER),
        timeline.format_line("decode", "a", DECODE),
        timeline.format_line("router", "b", {k: v + 1 for k, v in ROUTER.items()}),
        timeline.format_line("decode", "b", {k: (v + 1 if k.startswith("t_") else v)
                                             for k, v in DECODE.items()}),
        timeline.format_line("router", "only-router", ROUTER)])
    medians, count = timeline.median_breakdown(text)
    assert count == 2
    assert math.isclose(medians["total"], 60.0, abs_tol=1e-3)
    assert timeline.median_breakdown("nothing here") == ({}, 0)


def test_details_show_under_their_phase_and_stay_out_of_the_sum():
    with_details = {**DECODE, "p_digest": 0.0001, "d_bytes_check": 0.0004}
    text = "\n".join([timeline.format_line("router", "a", ROUTER),
                      timeline.format_line("decode", "a", with_details),
                      timeline.format_line("router", "b", ROUTER),
                      timeline.format_line("decode", "b", DECODE)])  # an older decode
    medians, count = timeline.median_breakdown(text)
    assert count == 2
    assert math.isclose(medians["prefill_sample.digest"], 0.1, abs_tol=1e-6)
    assert math.isclose(medians["verify.bytes"], 0.4, abs_tol=1e-6)  # only "a" has it
    assert math.isclose(medians["total"], 60.0, abs_tol=1e-3)
    rows = timeline.table(medians, count).splitlines()
    under = {row.split()[0]: rows[i - 1].split()[0] for i, row in enumerate(rows)
             if row.startswith("    ")}
    assert under == {"digest": "prefill_sample", "bytes": "verify"}


def test_a_prefill_that_reports_its_digest_part_adds_it_and_an_older_one_adds_none():
    clock = PullClock("t", 1.0, 1.0)
    clock.add_prefill((0.001, 0.002, 0.003, 0.001))
    clock.add_prefill((0.001, 0.002, 0.003))
    assert clock.prefill_timings_dropped == 0
    assert math.isclose(clock.p_sample, 0.006) and math.isclose(clock.p_digest, 0.001)


@pytest.mark.parametrize("bad", [(1.0, 2.0), (float("nan"), 0.0, 0.0), (-1.0, 0.0, 0.0),
                                 (0.0, 1e9, 0.0), ("1", 0.0, 0.0),
                                 (0.0, 0.0, 0.0, 0.0, 0.0)])
def test_prefill_timings_that_are_not_seconds_are_dropped(bad):
    clock = PullClock("t", 1.0, 1.0)
    clock.add_prefill((0.001, 0.002, 0.003))
    clock.add_prefill(bad)
    assert clock.prefill_timings_dropped == 1
    assert (clock.p_queued, clock.p_write, clock.p_sample) == (0.001, 0.002, 0.003)


def test_decode_logs_one_ordered_timeline_per_load_on_the_real_scheduler(caplog):
    from testkit import pd_harness as pd

    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    d = pd.build_instance("kv_consumer", 1, pd.free_port(), model="dense")
    try:
        with caplog.at_level(logging.DEBUG, logger="vllm_flagcx"):
            records = pd.run_pd(p, d, [40, 70, 100])
    finally:
        p.shutdown()
        d.shutdown()
    lines = timeline.parse_lines([r.getMessage() for r in caplog.records])["decode"]
    assert set(lines) == set(records)  # one per load, by transfer id
    order = ("t_planned", "t_started", "t_sheet", "t_answered", "t_verified", "t_reported")
    for values in lines.values():
        stamps = [values[k] for k in order]
        assert stamps == sorted(stamps), values  # one clock, read in the order it happens
        assert values["p_write"] > 0  # prefill's own write time came in the reply
        work = values["p_queued"] + values["p_write"] + values["p_sample"]
        assert work <= values["t_answered"] - values["t_sheet"]
        assert 0 < values["p_digest"] <= values["p_sample"]  # this prefill reports it
        checks = values["d_bytes_check"] + values["d_digest"]
        assert values["d_digest"] > 0 and checks <= values["t_verified"] - values["t_answered"]


def test_the_router_logs_its_timeline_at_info_when_asked(caplog):
    with rs.upstream("prefill") as p, rs.upstream("decode") as d, \
            router([p], [d], log_timelines=True) as (url, _), \
            caplog.at_level(logging.INFO, logger="vllm_flagcx.router"):
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 200
        with httpx.stream("POST", url + "/v1/completions", json=BODY | {"stream": True},
                          timeout=10) as s:
            list(s.iter_lines())
    lines = timeline.parse_lines([r.getMessage() for r in caplog.records])["router"]
    assert len(lines) == 2
    assert {s["kv_transfer_params"]["transfer_id"] for s in p.seen} == set(lines)
    for values in lines.values():
        stamps = [values[k] for k in timeline.ROUTER_FIELDS]
        assert stamps == sorted(stamps), values


def test_the_router_logs_no_timeline_at_info_by_default(caplog):
    with rs.upstream("prefill") as p, rs.upstream("decode") as d, \
            router([p], [d]) as (url, _), \
            caplog.at_level(logging.INFO, logger="vllm_flagcx.router"):
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 200
    assert not timeline.parse_lines([r.getMessage() for r in caplog.records])["router"]
