"""B5: KV transfer inside real engines, and ``vllm bench serve`` PD vs monolithic (GPU).

One prefill + decode pair of a CUDA vLLM on one GPU (the demo's sliding + full model,
bf16, FLASH_ATTN, FlagCXConnector over CUDA IPC) behind the router. For 1k, 8k and 32k-token
prompts (fresh random ids each repeat, so decode's prefix cache never serves one): the KV
bytes and seconds decode's connector counted for the request (``vllm:flagcx_received_*``:
side-channel round trip, the writes, the integrity check), against a device-to-device copy
of the same number of bytes in the same run. Then ``vllm bench serve`` (random dataset)
through the router (PD, sequential and concurrent mode) and straight at the prefill engine
(monolithic: a request without ``kv_transfer_params`` is plain vLLM there): TTFT and TPOT
side by side. Last, PD's time to first byte by phase (``wire.timeline``: the router's and
decode's lines joined by transfer id), per prompt size and under the serve load.

Needs a CUDA GPU and a CUDA vLLM; elsewhere it reports itself as not run.
"""

from __future__ import annotations

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
               "--enforce-eager", "--attention-backend", "FLASH_ATTN")
SERVE = ("--dataset-name", "random", "--random-input-len", "1024", "--random-output-len",
         "64", "--num-prompts", "64", "--request-rate", "8", "--seed", "0", "--ignore-eos")


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


def _transfers(d: Any, repeats: int) -> list[dict[str, Any]]:
    import engines

    from vllm_flagcx.demo import run as demo_run

    rng = random.Random(0)
    rows = []
    for size in SIZES:
        moved, seconds = [], []
        since = time.monotonic()
        for _ in range(repeats):
            prompt = [rng.randrange(2, 500) for _ in range(size)]
            before = demo_run.received(d.decode)
            # streamed: the router's first body byte is decode's first token, so the
            # breakdown's first_token phase holds that token only (not the whole answer)
            r = engines.complete(d.router.url, prompt, max_tokens=2, stream=True)
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


def _serve(d: Any, num_prompts: int, concurrent_url: str) -> dict[str, dict[str, Any]]:
    from vllm_flagcx.compat import bench

    argv = [*SERVE]
    argv[argv.index("--num-prompts") + 1] = str(num_prompts)
    from vllm_flagcx.demo import run as demo_run

    out = {}
    for name, url in (("pd_router", d.router.url), ("pd_concurrent", concurrent_url),
                      ("monolithic", d.prefill.url)):
        since = time.monotonic()
        result = bench.bench_serve(["--backend", "openai", "--base-url", url, "--model",
                                    "demo", "--tokenizer", str(d.model), *argv])
        out[name] = {k: result.get(k) for k in bench.SUMMARY_KEYS}
        if name == "pd_router":
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

    from vllm_flagcx.demo import servers as sv

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"  # the toy model says 4096 positions
    workdir = Path(tempfile.mkdtemp(prefix="b5-"))
    d = engines.Deployment(workdir, "sliding", "bfloat16", engine_args=ENGINE_ARGS,
                           cpu_isa="auto", max_model_len=MAX_MODEL_LEN)
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
            rows = _transfers(d, 2 if quick else 5)
            serve = _serve(d, 16 if quick else 64, concurrent.url)
    text = report.table(
        "B5 KV transfer inside real engines (CUDA vLLM, FLASH_ATTN bf16, CUDA IPC) vs a "
        "device copy of the same bytes",
        ("prompt tokens", "KV bytes", "transfer ms", "device copy ms", "GB/s", "copy GB/s"),
        [(r["prompt_tokens"], r["kv_bytes"], f"{r['transfer_ms']:.2f}",
          f"{r['device_copy_ms']:.3f}", f"{r['transfer_GBps']:.1f}",
          f"{r['device_copy_GBps']:.1f}") for r in rows])
    text += "\n\n" + report.table(
        "vllm bench serve (random 1024 in / 64 out, 8 req/s): PD through the router "
        "(sequential, concurrent) vs the monolithic engine",
        ("run", "completed", "failed", "mean TTFT ms", "p99 TTFT ms", "mean TPOT ms",
         "p99 TPOT ms"),
        [(name, s["completed"], s["failed"], f"{s['mean_ttft_ms']:.1f}",
          f"{s['p99_ttft_ms']:.1f}", f"{s['mean_tpot_ms']:.2f}", f"{s['p99_tpot_ms']:.2f}")
         for name, s in serve.items()])
    text += "\n\n" + _breakdown_text(rows, serve)
    return {"name": "b5_engines", "text": text, "engines_ready_seconds": round(ready, 1),
            "extra_config": extra,
            "rows": rows, "serve": serve, "engine_args": list(ENGINE_ARGS)}


def _breakdown_text(rows: list[dict[str, Any]], serve: dict[str, dict[str, Any]]) -> str:
    """PD's time to first byte by phase (median ms, from the router's and decode's
    ``wire.timeline`` lines), one column per prompt size and one for the serve run."""
    from vllm_flagcx.wire import timeline

    columns = [(f"{r['prompt_tokens']} tok (n={r['breakdown_requests']})", r["breakdown_ms"])
               for r in rows]
    pd = serve.get("pd_router", {})
    columns.append((f"serve 8/s (n={pd.get('breakdown_requests', 0)})",
                    pd.get("breakdown_ms", {})))
    names = [name for phase, _ in timeline.PHASES
             for name in (phase, *(d for d, _, parent, _ in timeline.DETAILS
                                   if parent == phase))]
    names.append("total")
    return report.table(
        "PD time to first byte by phase, median ms (router + decode timelines, one clock); "
        "every request streamed, so first_token ends at decode's first token",
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
