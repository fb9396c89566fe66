"""B5: KV transfer inside real engines, and ``vllm bench serve`` PD vs monolithic (GPU).

One prefill + decode pair of a CUDA vLLM on one GPU (a model of the target's real width,
``benchmarks.wide_models``: ``VLLM_FLAGCX_B5_MODEL`` = hybrid-wide (default) or
dense-wide; bf16, FLASH_ATTN, FlagCXConnector over CUDA IPC, vLLM's default CUDA graph
mode; ``VLLM_FLAGCX_B5_EAGER=1`` is the ``--enforce-eager`` variant) behind the router.
Unloaded, per prompt size: PD's and the monolithic engine's time to the first and the
second token, streamed, one request at a time. For 1k, 8k and 32k-token
prompts (fresh random ids each repeat, so decode's prefix cache never serves one): the KV
bytes and seconds decode's connector counted for the request
(``vllm:flagcx_bytes_transferred_sum``, ``vllm:flagcx_pull_seconds_sum``: side-channel
round trip, the writes, the integrity check), against a device-to-device copy
of the same number of bytes in the same run. Then ``vllm bench serve`` (random dataset)
through the router (PD, sequential and concurrent mode) and straight at the prefill engine
(monolithic: a request without ``kv_transfer_params`` is plain vLLM there): TTFT and TPOT
side by side. Last, PD's time to first byte by phase (``wire.timeline``: the router's and
decode's lines joined by transfer id), per prompt size and under the serve load.

Needs a CUDA GPU and a CUDA vLLM; elsewhere it reports itself as not run.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import report, use_test_helpers

SIZES = (1024, 8192, 32768)
MAX_MODEL_LEN = 33024
# --kv-cache-memory-bytes: two engines started at once on one GPU each measure the other's
# allocations as used memory, and decode died with "No available memory for the cache
# blocks" under --gpu-memory-utilization alone (issue 27, on the H200); the GPU suite
# passes a fixed size too.
ENGINE_ARGS = ("--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(4 << 30),
               "--attention-backend", "FLASH_ATTN", "--load-format", "dummy")
SERVE = ("--dataset-name", "random", "--random-input-len", "1024", "--random-output-len",
         "64", "--num-prompts", "64", "--request-rate", "8", "--seed", "0", "--ignore-eos")
RATES = (4, 8, 16, 32)  # req/s of the serve sweep (PD sequential and monolithic)
MODEL_ENV, EAGER_ENV = "VLLM_FLAGCX_B5_MODEL", "VLLM_FLAGCX_B5_EAGER"


def one_token_bias(model: Path) -> dict[str, float]:
    """``logit_bias`` that makes every sampled token one plain ASCII token: vLLM's dummy
    weights put the greedy pick on tokens that print nothing or half a UTF-8 character,
    and a first token that ends inside a character is never sent ahead by the router
    (``router.first_token``): 127 of 287 requests of the first H200 run went the plain
    way. B5 times the path every real model's ordinary token takes."""
    from tokenizers import Tokenizer

    token = Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id("a")
    return {str(token): 100.0}


def _stream_times(client: Any, url: str, prompt: list[int], max_tokens: int,
                  extra: dict[str, Any]) -> tuple[float, float, float]:
    """Seconds to the first and to the second token event of a streamed completion, and
    the mean seconds per token after the first (TPOT), as a client sees them. ``client``:
    one ``httpx.Client`` for the run (a new one per request spent ~30 ms loading CA
    certificates inside the timed span, on PD and monolithic alike)."""
    started = time.monotonic()
    stamps: list[float] = []
    with client.stream("POST", url + "/v1/completions", timeout=300, json={
            "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, **extra}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise AssertionError(f"{url}: {event['error']}")
            # every event with a choice is a token, text or not (as vllm bench serve
            # counts them)
            if event.get("choices"):
                stamps.append(time.monotonic() - started)
    assert len(stamps) >= 2, f"{url}: {len(stamps)} token events"
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return stamps[0], stamps[1], tpot


def _unloaded(d: Any, sizes: tuple[int, ...], repeats: int, extra: dict[str, Any],
              concurrent_url: str) -> list[dict[str, Any]]:
    """Per prompt size, the time to the first and the second token (median ms over
    ``repeats`` fresh random prompts, one request at a time) of PD (sequential router,
    t1 from prefill), PD in the router's concurrent mode (``conc``: decode's leg starts
    with prefill's and decode computes t1) and the monolithic engine."""
    import httpx

    client = httpx.Client()
    paths = {"pd": d.router.url, "conc": concurrent_url, "mono": d.prefill.url}
    for url in paths.values():  # warm every path and its connections
        _stream_times(client, url, list(range(2, 66)), 4, extra)
    rng = random.Random(1)
    rows = []
    for size in sizes:
        got: dict[str, list[tuple[float, float, float]]] = {side: [] for side in paths}
        # one untimed prompt of this size per path first: Triton autotunes the GDN
        # kernels per new shape (1.8-2.9 s once), on whichever engine meets it first
        warm = [rng.randrange(2, 500) for _ in range(size)]
        for url in paths.values():
            _stream_times(client, url, warm, 2, extra)
        for _ in range(repeats):
            prompt = [rng.randrange(2, 500) for _ in range(size)]
            for side, url in paths.items():
                got[side].append(_stream_times(client, url, prompt, 16, extra))
        row: dict[str, Any] = {"prompt_tokens": size}
        for side, samples in got.items():
            for i, name in enumerate(("ttft_ms", "second_token_ms", "tpot_ms")):
                row[f"{side}_{name}"] = statistics.median(s[i] for s in samples) * 1e3
                row[f"{side}_{name}_all"] = [round(s[i] * 1e3, 2) for s in samples]
        row["ttft_ratio"] = row["pd_ttft_ms"] / row["mono_ttft_ms"]
        row["second_token_gap_ms"] = row["pd_second_token_ms"] - row["mono_second_token_ms"]
        row["conc_ttft_ratio"] = row["conc_ttft_ms"] / row["mono_ttft_ms"]
        row["conc_second_token_gap_ms"] = (row["conc_second_token_ms"]
                                           - row["mono_second_token_ms"])
        rows.append(row)
    return rows


def _device_copy_seconds(nbytes: int, repeats: int = 10) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    samples = []
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples[2:])


def _transfers(d: Any, repeats: int, sizes: tuple[int, ...], extra: dict[str, Any]
               ) -> list[dict[str, Any]]:
    import engines

    from vllm_flagcx.demo import run as demo_run

    rng = random.Random(0)
    rows = []
    for size in sizes:
        moved, seconds = [], []
        since = time.monotonic()
        for _ in range(repeats):
            prompt = [rng.randrange(2, 500) for _ in range(size)]
            before = demo_run.received(d.decode)
            # streamed: the router's first body byte is decode's first token, so the
            # breakdown's first_token phase holds that token only (not the whole answer)
            r = engines.complete(d.router.url, prompt, max_tokens=2, stream=True,
                                 ignore_eos=True, **extra)
            assert r.status_code == 200, r.text
            got_bytes, got_seconds = demo_run.transfer_after(d.decode, before)
            moved.append(got_bytes)
            seconds.append(got_seconds)
        nbytes = int(statistics.median(moved))
        copy = _device_copy_seconds(max(nbytes, 1))
        xfer = statistics.median(seconds)
        time.sleep(0.5)  # decode writes a load's timeline line at its next step
        phases, count = demo_run.breakdown(d.router, d.decode, since)
        rows.append({"prompt_tokens": size, "kv_bytes": nbytes, "transfer_ms": xfer * 1e3,
                     "breakdown_ms": phases, "breakdown_requests": count,
                     "transfer_ms_all": [s * 1e3 for s in seconds],
                     "device_copy_ms": copy * 1e3,
                     "transfer_GBps": nbytes / xfer / 1e9 if xfer else 0.0,
                     "device_copy_GBps": nbytes / copy / 1e9})
    return rows


def _serve(d: Any, num_prompts: int, concurrent_url: str, rates: tuple[int, ...],
           goodput: list[str], extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``vllm bench serve`` at each rate: PD sequential and monolithic; PD concurrent at
    8 req/s. ``goodput``: vLLM's ``--goodput`` SLO arguments."""
    from vllm_flagcx.compat import bench
    from vllm_flagcx.demo import run as demo_run

    out = {}
    runs = [(f"{name}@{rate}", url, rate) for rate in rates
            for name, url in (("pd_router", d.router.url), ("monolithic", d.prefill.url))]
    runs.append(("pd_concurrent@8", concurrent_url, 8))
    for name, url, rate in runs:
        argv = [*SERVE]
        argv[argv.index("--num-prompts") + 1] = str(num_prompts)
        argv[argv.index("--request-rate") + 1] = str(rate)
        since = time.monotonic()
        result = bench.bench_serve(["--backend", "openai", "--base-url", url, "--model",
                                    "demo", "--tokenizer", str(d.model), *argv,
                                    *(["--goodput", *goodput] if goodput else []),
                                    "--extra-body", json.dumps(extra)])
        out[name] = {k: result.get(k) for k in (*bench.SUMMARY_KEYS, "request_goodput")}
        out[name]["rate"] = rate
        if name.startswith("pd_router"):
            time.sleep(0.5)
            phases, count = demo_run.breakdown(d.router, d.decode, since)
            out[name] |= {"breakdown_ms": phases, "breakdown_requests": count}
    return out


EXTRA_ENV = "VLLM_FLAGCX_B5_EXTRA"  # JSON merged into both engines' extra config


def _extra_from_env() -> dict[str, Any]:
    """Connector settings for an A/B run of B5 (``VLLM_FLAGCX_B5_EXTRA='{"key": v}'``)."""
    import json

    raw = os.environ.get(EXTRA_ENV, "")
    return dict(json.loads(raw)) if raw else {}


def _merge_extra_config(argv: list[str], extra: dict[str, Any]) -> None:
    import json

    if not extra:
        return
    at = argv.index("--kv-transfer-config") + 1
    config = json.loads(argv[at])
    config["kv_connector_extra_config"] = {**config["kv_connector_extra_config"], **extra}
    argv[at] = json.dumps(config)


def run(quick: bool) -> dict[str, Any]:
    skipped = report.not_run_without_cuda("b5_engines", "B5 transfer inside engines")
    if skipped is not None:
        return skipped
    use_test_helpers()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
    import engines

    from benchmarks import wide_models
    from vllm_flagcx.demo import servers as sv

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    kind = os.environ.get(MODEL_ENV, "hybrid-wide")
    eager = os.environ.get(EAGER_ENV) == "1"
    sizes = SIZES[:1] if quick else SIZES
    for size in sizes:
        wide_models.check_prompt_fits(kind, size, 16)
    workdir = Path(tempfile.mkdtemp(prefix="b5-"))
    engine_args = (*ENGINE_ARGS, *wide_models.ENGINE_ARGS[kind],
                   *(("--enforce-eager",) if eager else ()))
    d = engines.Deployment(workdir, dtype="bfloat16", engine_args=engine_args,
                           cpu_isa="auto", max_model_len=MAX_MODEL_LEN,
                           model=wide_models.write(workdir / "model", kind))
    extra = _extra_from_env()
    for server in (d.prefill, d.decode):
        _merge_extra_config(server.argv, extra)
    # our router's concurrent mode too: decode's leg starts with prefill's, its pull waits
    # at prefill's side channel until the KV is ready (no breakdown: the legs overlap)
    concurrent = sv.router_server(sys.executable, engines.rs.free_port(),
                                  workdir / "router-concurrent.log", [d.prefill], [d.decode],
                                  d.side, mode="concurrent")
    with sv.running([d.prefill, d.decode]):
        ready = sv.wait_healthy([d.prefill, d.decode], engines.START_TIMEOUT)
        with sv.running([d.router, concurrent]):
            sv.wait_healthy([d.router, concurrent], 60)
            bias = {"logit_bias": one_token_bias(d.model)}
            unloaded = _unloaded(d, sizes, 3 if quick else 5, bias, concurrent.url)
            rows = _transfers(d, 2 if quick else 5, sizes, bias)
            base = next(r for r in unloaded if r["prompt_tokens"] == 1024) \
                if any(r["prompt_tokens"] == 1024 for r in unloaded) else unloaded[0]
            slo = [f"ttft:{3 * base['mono_ttft_ms']:.1f}",
                   f"tpot:{1.5 * base['mono_tpot_ms']:.2f}"]
            serve = _serve(d, 16 if quick else 64, concurrent.url,
                           RATES[:1] if quick else RATES, slo, bias)
            router_counters = json.loads(sv.get_text(d.router.url + "/stats"))["counters"]
    text = report.table(
        f"B5 {kind}, {'eager (--enforce-eager)' if eager else 'CUDA graphs'}: PD (router, "
        "first token from prefill; conc: the router's concurrent mode, decode computes it) "
        "vs the monolithic engine, unloaded, streamed, median ms",
        ("prompt tokens", "PD TTFT", "mono TTFT", "ratio", "PD 2nd tok", "mono 2nd tok",
         "2nd gap", "PD TPOT", "mono TPOT", "conc TTFT", "conc ratio", "conc 2nd gap"),
        [(u["prompt_tokens"], f"{u['pd_ttft_ms']:.1f}", f"{u['mono_ttft_ms']:.1f}",
          f"{u['ttft_ratio']:.3f}", f"{u['pd_second_token_ms']:.1f}",
          f"{u['mono_second_token_ms']:.1f}", f"{u['second_token_gap_ms']:+.1f}",
          f"{u['pd_tpot_ms']:.2f}", f"{u['mono_tpot_ms']:.2f}", f"{u['conc_ttft_ms']:.1f}",
          f"{u['conc_ttft_ratio']:.3f}", f"{u['conc_second_token_gap_ms']:+.1f}")
         for u in unloaded])
    text += "\n\n" + report.table(
        "KV transfer inside the engines (decode's connector counters) vs a device copy of "
        "the same bytes",
        ("prompt tokens", "KV bytes", "transfer ms", "device copy ms", "GB/s", "copy GB/s"),
        [(r["prompt_tokens"], r["kv_bytes"], f"{r['transfer_ms']:.2f}",
          f"{r['device_copy_ms']:.3f}", f"{r['transfer_GBps']:.1f}",
          f"{r['device_copy_GBps']:.1f}") for r in rows])
    text += "\n\n" + report.table(
        f"vllm bench serve (random 1024 in / 64 out), goodput at {' '.join(slo)} (3 x / "
        "1.5 x monolithic's unloaded 1k TTFT / TPOT); both engines on one GPU",
        ("run", "completed", "failed", "mean TTFT", "p99 TTFT", "mean TPOT", "p99 TPOT",
         "req/s", "goodput"),
        [(name, s["completed"], s["failed"], f"{s['mean_ttft_ms']:.1f}",
          f"{s['p99_ttft_ms']:.1f}", f"{s['mean_tpot_ms']:.2f}", f"{s['p99_tpot_ms']:.2f}",
          f"{s['request_throughput'] or 0:.2f}", f"{s['request_goodput'] or 0:.2f}")
         for name, s in serve.items()])
    text += "\n\n" + _breakdown_text(rows, serve)
    text += f"\n\nrouter counters (sequential): {router_counters}"
    return {"name": "b5_engines", "text": text, "engines_ready_seconds": round(ready, 1),
            "model": kind, "eager": eager, "extra_config": extra, "slo": slo,
            "unloaded": unloaded, "rows": rows, "serve": serve,
            "router_counters": router_counters,
            "engine_args": list(engine_args), "model_config": wide_models.MODELS[kind]}


def _breakdown_text(rows: list[dict[str, Any]], serve: dict[str, dict[str, Any]]) -> str:
    """PD's time to first byte by phase (median ms, from the router's and decode's
    ``wire.timeline`` lines), one column per prompt size and one for the serve run."""
    from vllm_flagcx.wire import timeline

    columns = [(f"{r['prompt_tokens']} tok (n={r['breakdown_requests']})", r["breakdown_ms"])
               for r in rows]
    pd = serve.get("pd_router@8", {})
    columns.append((f"serve 8/s (n={pd.get('breakdown_requests', 0)})",
                    pd.get("breakdown_ms", {})))
    names = [name for phase, _ in timeline.PHASES
             for name in (phase, *(d for d, _, parent, _ in timeline.DETAILS
                                   if parent == phase))]
    names += ["total", timeline.SEEDED]
    return report.table(
        "PD time to first byte by phase, median ms (router + decode timelines, one clock); "
        "every request streamed; the first token comes from prefill (client_first_token), "
        "so first_token and total end at decode's first, the answer's 2nd token",
        ("phase", *(c for c, _ in columns)),
        [(name, *(f"{v.get(name, 0.0):.3f}" for _, v in columns)) for name in names])


def chart(result: dict[str, Any], out_dir: Any) -> None:
    rows = result["rows"]
    if not rows:
        return
    report.bar_chart(out_dir, "b5_engines", "B5 KV transfer inside engines vs device copy",
                     [f"{r['prompt_tokens']:,} tokens" for r in rows],
                     {"transfer (connector counters)": [r["transfer_ms"] for r in rows],
                      "device copy, same bytes": [r["device_copy_ms"] for r in rows]}, "ms")
