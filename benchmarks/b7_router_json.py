"""B7: the router's JSON on the path to first byte, its own functions against the stdlib.

Per request, the sequential router parses the client's body (``app.parse_body``), writes
prefill's leg (``legs.encode``), reads prefill's answer with the prompt's token ids
(``legs.json_object``) and writes decode's leg with them. The baseline is what it did
before (stdlib ``json``: ``json.loads`` plus a ``json.dumps`` check of the body, httpx's
``json=``, ``response.json()``), measured in the same run on the same bodies: B5's
token-id prompts of 1k, 8k and 32k tokens.
"""

from __future__ import annotations

import functools
import json
import random
import statistics
import time
from typing import Any

from benchmarks import report

SIZES = (1024, 8192, 32768)


def _ms(fn: Any, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e3


URL = "http://127.0.0.1:1/v1/completions"  # never sent: the requests are only built


def _stdlib(raw: bytes, body: dict[str, Any], answer: Any) -> None:
    """What the router did before, per request."""
    import httpx

    json.dumps(json.loads(raw), ensure_ascii=False).encode()
    httpx.Request("POST", URL, json=body)
    answer.json()
    httpx.Request("POST", URL, json=body)


def _router(raw: bytes, body: dict[str, Any], answer: Any) -> None:
    from vllm_flagcx.router import app, legs

    app.parse_body(raw)
    legs.encode(body)
    legs.json_object(answer, "prefill", URL)
    legs.encode(body)


def run(quick: bool) -> dict[str, Any]:
    import httpx

    rng = random.Random(0)
    repeats = 5 if quick else 30
    rows = []
    for size in SIZES:
        ids = [rng.randrange(2, 151_000) for _ in range(size)]
        raw = json.dumps({"model": "demo", "prompt": ids, "max_tokens": 16,
                          "stream": True}).encode()
        answer = httpx.Response(200, content=json.dumps({"choices": [{
            "text": "a", "prompt_token_ids": ids}], "kv_transfer_params": {}}).encode())
        body = json.loads(raw)

        base = _ms(functools.partial(_stdlib, raw, body, answer), repeats)
        ours = _ms(functools.partial(_router, raw, body, answer), repeats)
        rows.append({"prompt_tokens": size, "stdlib_ms": base, "router_ms": ours,
                     "ratio": ours / base})
    text = report.table(
        "B7 the router's JSON per request (parse the body, write prefill's leg, read its "
        "answer with the ids, write decode's leg), median ms",
        ("prompt tokens", "stdlib json (before)", "router (msgspec)", "ratio"),
        [(r["prompt_tokens"], r["stdlib_ms"], r["router_ms"], f"{r['ratio']:.2f}")
         for r in rows])
    return {"name": "b7_router_json", "text": text, "rows": rows}


def chart(result: dict[str, Any], out_dir: Any) -> None:
    rows = result["rows"]
    report.bar_chart(out_dir, "b7_router_json", "B7 router JSON per request (ms)",
                     [f"{r['prompt_tokens']:,} tokens" for r in rows],
                     {"stdlib": [r["stdlib_ms"] for r in rows],
                      "router": [r["router_ms"] for r in rows]}, "milliseconds")
