"""The router against stand-in upstreams (``router_standin``): what each leg is sent, what
the client gets when a leg fails, disconnects, least-loaded choice, flag errors. Real
engines behind the router: ``test_e2e.py``."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time

import httpx
import pytest
from testkit import router_standin as rs

from vllm_flagcx.router import cli
from vllm_flagcx.router.app import build_app
from vllm_flagcx.router.legs import RouterSettings, prefill_body
from vllm_flagcx.router.pool import Instance, Pool, RouterConfigError, parse_instance
from vllm_flagcx.router.proxy import Proxy

BODY = {"model": "demo", "prompt": "100 + 100 =", "max_tokens": 8, "temperature": 0,
        "stop": ["\n"]}


@contextlib.contextmanager
def router(prefills, decodes, **settings):
    proxy = Proxy(Pool("prefill", [Instance(u.url, "prefill", getattr(u, "side", None))
                                   for u in prefills]),
                  Pool("decode", [Instance(u.url, "decode") for u in decodes]),
                  RouterSettings(**settings))
    with rs.serving(build_app(proxy)) as port:
        yield f"http://127.0.0.1:{port}", proxy


def test_prefill_leg_is_one_length_capped_token_and_decode_gets_its_params_unchanged():
    with rs.upstream("prefill") as p, rs.upstream("decode", text="two hundred") as d, \
            router([p], [d]) as (url, _):
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "two hundred"
    sent_p, sent_d = p.seen[0], d.seen[0]
    assert sent_p["max_tokens"] == 1 and sent_p["stream"] is False and sent_p["ignore_eos"]
    assert "stop" not in sent_p  # a stop string must not end the one-token leg early
    tid = sent_p["kv_transfer_params"]["transfer_id"]
    assert sent_p["kv_transfer_params"]["do_remote_decode"] is True and tid.startswith("flagcx-")
    assert sent_d["kv_transfer_params"] == p.params(sent_p)
    assert {k: v for k, v in sent_d.items() if k != "kv_transfer_params"} == BODY


def test_streaming_passes_sse_through():
    with rs.upstream("prefill") as p, rs.upstream("decode", text="a b c") as d, \
            router([p], [d]) as (url, _), \
            httpx.stream("POST", url + "/v1/completions", json=BODY | {"stream": True},
                         timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == ["a", "b", "c"]
    assert events[-1] == "data: [DONE]" and p.seen[0]["stream"] is False


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


def test_concurrent_mode_learns_prefill_by_handshake_and_sends_both_legs():
    """--mode concurrent asks prefill's side channel for its fact sheet (engine id, TP)
    before either leg; this path runs with the [router] extras alone (tox -e novllm)."""
    with rs.side_channel() as (port, seen), rs.upstream("prefill") as p, \
            rs.upstream("decode") as d:
        p.side = port
        with router([p], [d], mode="concurrent") as (url, _proxy):
            r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
            r2 = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
    assert r.status_code == 200 and r2.status_code == 200, r.text
    params = d.seen[0]["kv_transfer_params"]
    assert params["remote_engine_id"] == "standin-engine" and params["remote_tp_size"] == 2
    assert params["remote_port"] == port and params["do_remote_prefill"] is True
    assert sum(type(m).__name__ == "HandshakeRequest" for m in seen) == 1  # cached


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


def test_least_loaded_instance_is_picked_and_idle_ones_rotate():
    pool = Pool("decode", [Instance("http://127.0.0.1:1", "decode"),
                           Instance("http://127.0.0.1:2", "decode")])
    pool.instances[0].in_flight = 3
    assert pool.pick() is pool.instances[1]
    pool.instances[0].in_flight = 0
    assert {pool.pick().url for _ in range(4)} == {i.url for i in pool.instances}


def test_concurrent_requests_spread_over_two_decodes():
    with rs.upstream("prefill") as p, rs.upstream("decode", delay=0.5) as d1, \
            rs.upstream("decode", delay=0.5) as d2, router([p], [d1, d2]) as (url, _):
        threads = [threading.Thread(target=httpx.post, args=(url + "/v1/completions",),
                                    kwargs={"json": BODY, "timeout": 10}) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(d1.seen) + len(d2.seen) == 6 and d1.seen and d2.seen


def test_health_and_models_pass_through():
    with rs.upstream("prefill") as p, rs.upstream("decode") as d, \
            router([p], [d]) as (url, _):
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "demo"
        d.status = 503
        sick = httpx.get(url + "/health")
    assert sick.status_code == 503 and sick.json()[f"decode {d.url}"] == "HTTP 503"


def test_bad_body_is_a_400():
    with rs.upstream("prefill") as p, rs.upstream("decode") as d, \
            router([p], [d]) as (url, _):
        r = httpx.post(url + "/v1/completions", content=b"not json", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("raw, match", [
    (b'{"prompt": "x", "stream": "false"}', "stream must be true or false"),
    (b'{"prompt": "x", "stream": 0}', "stream must be true or false"),
    (b'{"prompt": "x", "temperature": NaN}', "NaN is not JSON"),
    (b'{"prompt": "x", "temperature": -Infinity}', "-Infinity is not JSON"),
    (b'{"prompt": "\\ud800"}', "lone UTF-16 surrogate"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper"),
    (b"\xff\xfe", "not UTF-8|must be JSON"),
    (b"[1, 2]", "JSON object"),
])
def test_bodies_the_router_cannot_forward_are_a_400_naming_why(raw, match):
    with rs.upstream("prefill") as p, rs.upstream("decode") as d, \
            router([p], [d]) as (url, proxy):
        r = httpx.post(url + "/v1/completions", content=raw, timeout=20)
    assert r.status_code == 400, r.text
    assert re.search(match, r.json()["error"]["message"]), r.text
    assert not p.seen and not d.seen
    assert proxy.counters["bad_requests"] == 1 and not proxy.counters["client_disconnects"]


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


def test_router_takes_the_side_channel_secret_and_refuses_a_short_one(tmp_path,
                                                                      monkeypatch):
    from vllm_flagcx.wire import auth

    args = ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"]
    monkeypatch.setenv(auth.SECRET_ENV, "s" * 24)
    assert cli.build(cli.parser().parse_args(args)) is not None
    short = tmp_path / "secret"
    short.write_text("short")
    with pytest.raises(RouterConfigError, match="--side-channel-secret-file"):
        cli.build(cli.parser().parse_args([*args, "--side-channel-secret-file", str(short)]))


@pytest.mark.parametrize("spec, match", [
    (["127.0.0.1:8000"], "scheme, host and port"),
    (["http://127.0.0.1"], "scheme, host and port"),
    (["http://127.0.0.1:8000", "x"], "SIDE_CHANNEL_PORT"),
    (["http://127.0.0.1:8000", "1", "2"], "URL \\[SIDE_CHANNEL_PORT\\]"),
])
def test_bad_instance_flags_are_named(spec, match):
    with pytest.raises(RouterConfigError, match=match):
        parse_instance(spec, "prefill")


def test_cli_rejects_missing_pools_and_concurrent_without_ports(capsys):
    assert cli.main(["--decode", "http://127.0.0.1:2"]) == 2
    assert "--prefill" in capsys.readouterr().out
    assert cli.main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                     "--mode", "concurrent"]) == 2
    assert "SIDE_CHANNEL_PORT" in capsys.readouterr().out


def test_prefill_body_keeps_chat_limits_at_one():
    out = prefill_body({"messages": [], "max_completion_tokens": 50, "n": 2,
                        "stream_options": {"include_usage": True}, "stream": True}, "t")
    assert out["max_completion_tokens"] == 1 and out["max_tokens"] == 1
    assert "n" not in out and "stream_options" not in out and out["stream"] is False


def test_design_note_router_script_takes_its_flags(tmp_path):
    """examples/disaggregated_serving_xpyd/router.py with the design note's flags serves,
    and /health names the prefill and decode instances it was given."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "examples/disaggregated_serving_xpyd/router.py"
    port, p_port, d_port = rs.free_port(), rs.free_port(), rs.free_port()
    proc = subprocess.Popen([sys.executable, str(script), "--host", "127.0.0.1", "--port",
                             str(port), "--prefill", f"http://127.0.0.1:{p_port}", "8998",
                             "--decode", f"http://127.0.0.1:{d_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "router.py exited"
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "router.py did not serve within 60 s"
                time.sleep(0.3)
        assert r.status_code == 503  # nothing listens behind it
        assert f"127.0.0.1:{p_port}" in r.text or f"127.0.0.1:{d_port}" in r.text
    finally:
        proc.terminate()
        proc.wait(20)


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
