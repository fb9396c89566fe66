"""The router when a leg fails: what the client gets (an HTTP error or a last SSE event naming
the instance, never a hang), what prefill is told to free, what is counted."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from testkit import router_standin as rs
from testkit.router_standin import BODY, router


def test_prefill_http_error_reaches_the_client_and_decode_is_not_asked():
    with rs.upstream("prefill", status=500) as p, rs.upstream("decode") as d, \
            router([p], [d]) as (url, _):
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        stats = httpx.get(url + "/stats").json()
    assert r.status_code == 500
    error = r.json()["error"]
    assert p.url in error["message"] and error["type"] == "prefill_error"
    assert error["upstream"]["error"]["message"] == "prefill says no"
    assert not d.seen and stats["counters"]["failed_prefill"] == 1


def test_unreachable_prefill_is_a_502_naming_it():
    dead = rs.Upstream("prefill", port=rs.free_port())
    with rs.upstream("decode") as d, router([dead], [d]) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 502 and dead.url in r.json()["error"]["message"]


def test_slow_prefill_times_out_with_504():
    with rs.upstream("prefill", delay=5) as p, rs.upstream("decode") as d, \
            router([p], [d], prefill_timeout=0.5) as (url, _):
        started = time.monotonic()
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        took = time.monotonic() - started
    assert r.status_code == 504 and took < 4
    assert not d.seen


def test_decode_dying_mid_stream_ends_with_an_error_event():
    with rs.upstream("prefill") as p, rs.upstream("decode", text="a b c d",
                                                 cut_stream_after=2) as d, \
            router([p], [d]) as (url, _), \
            httpx.stream("POST", url + "/v1/completions", json=BODY | {"stream": True},
                         timeout=10) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[0][6:])["choices"][0]["text"] == "a"
    error = json.loads(events[-2][6:])["error"]
    assert error["type"] == "decode_error" and d.url in error["message"]
    assert events[-1] == "data: [DONE]"


def test_decode_refusing_after_prefill_releases_what_prefill_holds():
    with rs.side_channel() as (port, seen), rs.upstream("prefill") as p, \
            rs.upstream("decode", status=400) as d:
        p.params = lambda body: {**rs.Upstream.params(p, body), "remote_port": port}
        with router([p], [d]) as (url, proxy):
            r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "decode_error"
    tid = p.seen[0]["kv_transfer_params"]["transfer_id"]
    assert [m.transfer_id for m in seen] == [tid]
    assert proxy.counters["released"] == 1


def test_client_leaving_during_prefill_cancels_it_and_never_asks_decode():
    with rs.upstream("prefill", delay=3) as p, rs.upstream("decode") as d, \
            router([p], [d]) as (url, proxy):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=BODY, timeout=0.7)
        deadline = time.monotonic() + 5
        while not p.cancelled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.cancelled == 1  # prefill saw its request go away (vLLM aborts it)
        time.sleep(0.3)
    assert not d.seen and proxy.counters["client_disconnects"] == 1


def test_prefill_without_params_lets_decode_compute_and_is_counted():
    with rs.upstream("prefill", return_params=False) as p, rs.upstream("decode") as d, \
            router([p], [d]) as (url, proxy):
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
    assert r.status_code == 200 and "kv_transfer_params" not in d.seen[0]
    assert proxy.counters["decode_recomputed"] == 1


def test_decode_answering_200_with_non_json_is_a_502_naming_it():
    with rs.upstream("prefill") as p, rs.upstream("decode", raw_body=b"<html>oops") as d, \
            router([p], [d]) as (url, proxy):
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
    assert r.status_code == 502
    error = r.json()["error"]
    assert d.url in error["message"] and "not JSON" in error["message"]
    assert proxy.counters["failed_decode"] == 1
    assert all(i.in_flight == 0 for i in proxy.decode.instances)


def test_concurrent_mode_with_the_side_channel_down_is_a_502_naming_prefill():
    with rs.upstream("prefill") as p, rs.upstream("decode") as d:
        p.side = rs.free_port()  # nothing listens there
        with router([p], [d], mode="concurrent", connect_timeout=1.0) as (url, proxy):
            r = httpx.post(url + "/v1/completions", json=BODY, timeout=20)
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert p.url in message and "side channel" in message
    assert not d.seen and proxy.counters["failed_prefill"] == 1
    assert not proxy.counters["client_disconnects"]


def test_failed_decode_legs_leave_no_request_counted_in_flight():
    """A refused and an unreachable decode each count as failed and leave the instance's
    in-flight count at 0, so least-loaded choice is not skewed by requests that ended."""
    with rs.upstream("prefill") as p, rs.upstream("decode", status=400) as refusing:
        gone = rs.free_port()
        dead = type("Gone", (), {"url": f"http://127.0.0.1:{gone}"})()
        with router([p], [refusing, dead]) as (url, proxy):
            codes = sorted(httpx.post(url + "/v1/completions", json=BODY, timeout=10)
                           .status_code for _ in range(2))
    assert codes == [400, 502]
    assert [i.in_flight for i in proxy.decode.instances] == [0, 0]
    assert [i.failed for i in proxy.decode.instances] == [1, 1]


def test_prefill_answering_200_with_non_json_is_a_502_naming_it():
    """Upstream garbage from prefill was a JSON 500 from the router; it is prefill's
    failure: a 502 naming prefill, and decode is never asked."""
    with rs.upstream("prefill", raw_body=b"<html>oops") as p, rs.upstream("decode") as d, \
            router([p], [d]) as (url, proxy):
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
    assert r.status_code == 502
    error = r.json()["error"]
    assert p.url in error["message"] and "not a JSON object" in error["message"]
    assert error["type"] == "prefill_error" and not d.seen
    assert all(i.in_flight == 0 for i in proxy.prefill.instances)
