"""The router's input: bodies it cannot forward (400s naming why), its flags and secret, the
design note's launch script."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from testkit import router_standin as rs
from testkit.router_standin import router

from vllm_flagcx.router import cli
from vllm_flagcx.router.legs import RouterConfigError, parse_instance, prefill_body


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
    (b'{"prompt": "x", "temperature": 1e400}', "out of a double's range"),
])
def test_bodies_the_router_cannot_forward_are_a_400_naming_why(raw, match):
    with rs.upstream("prefill") as p, rs.upstream("decode") as d, \
            router([p], [d]) as (url, proxy):
        r = httpx.post(url + "/v1/completions", content=raw, timeout=20)
    assert r.status_code == 400, r.text
    assert re.search(match, r.json()["error"]["message"]), r.text
    assert not p.seen and not d.seen
    assert proxy.counters["bad_requests"] == 1 and not proxy.counters["client_disconnects"]


@pytest.mark.parametrize("raw", [
    r'{"prompt": "caf\u00e9 \ud83d\ude00 \u2028", "max_tokens": 16, "stream": true}',
    '{"prompt": [1, 2, 151645], "temperature": 0.7, "top_p": 1e-3, "seed": 18446744073709551617}',
    r'{"messages": [{"role": "user", "content": "a\nb \"q\""}], "logit_bias": {"5": -1.5}}',
    '{"a": {"b": [null, true, false, [[], {}]]}, "a": 2, "n": -0.0}',
    '{"prompt": [' + ", ".join(str(i * 7919 % 151000) for i in range(32768)) + ']}',
])
def test_the_fast_json_path_reads_and_writes_what_the_stdlib_does(raw):
    """The router parses bodies and answers with msgspec and writes each leg with it
    (``app.parse_body``, ``legs.encode``, ``legs.json_object``): for every JSON the stdlib
    reads, the same object, and bytes the stdlib reads back to it."""
    import json

    from vllm_flagcx.router import app, legs

    body = app.parse_body(raw.encode())
    assert body == json.loads(raw)
    assert json.loads(legs.encode(body)) == body
    answer = httpx.Response(200, content=raw.encode())
    assert legs.json_object(answer, "prefill", "http://127.0.0.1:1") == body


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


def test_the_seeds_side_channel_port_is_checked_in_sequential_mode():
    """``--prefill URL 8998`` (the design note's form): in sequential mode prefill's
    returned ``remote_port`` must be that port, or the request fails fast naming
    ``side_channel_port``; decode is never sent a leg that would dial the wrong port, and
    what prefill holds is released."""
    with rs.upstream("prefill") as p, rs.upstream("decode") as d:
        p.side = 8998  # the stand-in advertises port 1
        with router([p], [d]) as (url, proxy):
            r = httpx.post(url + "/v1/completions", json=rs.BODY, timeout=10)
        assert r.status_code == 502
        assert "side_channel_port=8998" in r.json()["error"]["message"]
        assert d.seen == [] and proxy.counters["released"] == 1
        p.side = 1  # matching: served
        with router([p], [d]) as (url, _):
            assert httpx.post(url + "/v1/completions", json=rs.BODY, timeout=10
                              ).status_code == 200


def test_a_loopback_side_channel_is_refused_when_decode_is_on_another_host():
    from vllm_flagcx.router.legs import advertised_side_channel_problem as problem

    params = {"remote_host": "127.0.0.1", "remote_port": 5600}
    # decode on prefill's host (by name or by loopback): loopback is right
    assert problem("10.0.0.1", None, ["10.0.0.1"], params) is None
    assert problem("127.0.0.1", None, ["localhost", "::1"], params) is None
    # decode elsewhere: it would dial itself
    msg = problem("10.0.0.1", None, ["10.0.0.1", "10.0.0.2"], params)
    assert msg is not None and "side_channel_host" in msg and "10.0.0.2" in msg
    assert problem("10.0.0.1", None, ["10.0.0.2"],
                   {"remote_host": "10.0.0.1", "remote_port": 5600}) is None
    assert problem("10.0.0.1", 5601, ["10.0.0.1"], params) is not None  # port differs
    assert problem("10.0.0.1", None, ["10.0.0.2"], None) is None  # nothing held
