"""The router against stand-in upstreams (``router_standin``): what each leg is sent, streaming,
concurrent mode, least-loaded choice, pass-through routes. Failed legs:
``test_router_failures.py``; bad input and flags: ``test_router_inputs.py``; real engines
behind the router: ``tests/e2e``."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from testkit import router_standin as rs
from testkit.router_standin import BODY, router

from vllm_flagcx.router.legs import Instance, Pool


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


def test_concurrent_mode_learns_prefill_by_handshake_and_sends_both_legs():
    """--mode concurrent asks prefill's side channel for its fact sheet (engine id, TP)
    before either leg; this path runs with the [router] extras alone (tox -e novllm)."""
    with rs.side_channel() as (port, seen), rs.upstream("prefill", prompt_ids=[5]) as p, \
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
    # decode's leg leaves before prefill answers: it keeps the text, prefill is not asked
    assert d.seen[0]["prompt"] == BODY["prompt"] and "return_token_ids" not in p.seen[0]


def test_concurrent_mode_sends_the_prompt_to_the_prefill_decode_pulls_from():
    """With two prefills, decode's params and prefill's leg name the same instance (the
    router picked twice: decode pulled from one prefill while the other computed the
    prompt, waited out the timeout and recomputed)."""
    with rs.side_channel() as (port1, _), rs.side_channel() as (port2, _), \
            rs.upstream("prefill", delay=0.2) as p1, rs.upstream("prefill", delay=0.2) as p2, \
            rs.upstream("decode") as d:
        p1.side, p2.side = port1, port2
        with router([p1, p2], [d], mode="concurrent") as (url, _proxy):
            threads = [threading.Thread(target=httpx.post, args=(url + "/v1/completions",),
                                        kwargs={"json": BODY, "timeout": 10})
                       for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    computed_by = {b["kv_transfer_params"]["transfer_id"]: up.side
                   for up in (p1, p2) for b in up.seen}
    assert len(d.seen) == 6 and p1.seen and p2.seen
    for body in d.seen:
        params = body["kv_transfer_params"]
        assert computed_by[params["transfer_id"]] == params["remote_port"]


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


def test_decode_gets_the_prompt_as_the_token_ids_prefill_computed():
    """Sequential /v1/completions: the prefill leg asks for the prompt's token ids and the
    decode leg carries them as its prompt (decode does not tokenize the text again);
    everything else in decode's request is the client's."""
    with rs.upstream("prefill", prompt_ids=[5, 6, 7]) as p, \
            rs.upstream("decode", text="two hundred") as d, router([p], [d]) as (url, proxy):
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "two hundred"
    assert p.seen[0]["return_token_ids"] is True and p.seen[0]["prompt"] == BODY["prompt"]
    sent_d = d.seen[0]
    assert sent_d["prompt"] == [5, 6, 7] and "return_token_ids" not in sent_d
    assert {k: v for k, v in sent_d.items() if k not in ("kv_transfer_params", "prompt")} == {
        k: v for k, v in BODY.items() if k != "prompt"}
    assert proxy.counters["decode_prompt_ids"] == 1


@pytest.mark.parametrize("answered", [None, [], [1, "2"], [1, -2], [True], "1 2 3", [1.5]])
def test_decode_keeps_the_text_when_prefill_answers_no_usable_ids(answered):
    with rs.upstream("prefill", prompt_ids=answered) as p, rs.upstream("decode") as d, \
            router([p], [d]) as (url, proxy):
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 200
    assert d.seen[0]["prompt"] == BODY["prompt"]
    assert proxy.counters["decode_prompt_ids"] == 0


@pytest.mark.parametrize("extra,settings", [
    ({"echo": True}, {}),  # the answer echoes the prompt's text
    ({"prompt_logprobs": 1}, {}),
    ({"prompt": ["a", "b"]}, {}),  # not one text prompt
    ({}, {"prompt_token_ids": False}),  # --no-prompt-token-ids
])
def test_prefill_is_not_asked_for_ids_where_decode_keeps_the_text(extra, settings):
    with rs.upstream("prefill", prompt_ids=[5, 6, 7]) as p, rs.upstream("decode") as d, \
            router([p], [d], **settings) as (url, _):
        assert httpx.post(url + "/v1/completions", json=BODY | extra, timeout=10
                          ).status_code == 200
    assert "return_token_ids" not in p.seen[0]
    assert d.seen[0]["prompt"] == (BODY | extra)["prompt"]


def test_only_text_completions_of_one_prompt_take_ids():
    from vllm_flagcx.router.legs import prompt_ids_apply

    assert prompt_ids_apply("/v1/completions", {"prompt": "x"})
    assert not prompt_ids_apply("/v1/chat/completions", {"prompt": "x"})
    assert not prompt_ids_apply("/v1/completions", {"prompt": [1, 2]})
    assert not prompt_ids_apply("/v1/completions", {"prompt": "x", "echo": True})
