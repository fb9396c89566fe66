"""PD == monolithic on a real CUDA vLLM: prefill + decode engines on one GPU, FlagCXConnector
over CUDA IPC (the same-host transport), the router in front; per attention backend.

Needs a CUDA GPU and a CUDA build of vLLM (skipped elsewhere; CI has neither). On the lent
H200 with ``../shared/gpu-vllm``'s bundle::

    VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/site:$PWD \\
        python3 -m pytest -m gpu tests/gpu -v

Every pair is started at once (one GPU, ``GPU_MEMORY`` of it each) so the suite fits in a
device call. Cases: the sliding + full model on FLASH_ATTN (bf16, (2, num_blocks, ...)
layout) and TRITON_ATTN (float32, (num_blocks, 2, ...) layout) must give the monolithic
answer for every prompt with bytes moved. The Qwen3-Next-style hybrid (GDN conv + ssm state
with the attention KV) runs in bf16 on both backends: vLLM 0.22's CUDA GDN prefill kernel
refuses float32 (``ChunkGatedDeltaRuleFunction does not support float32``, measured on the
H200), and in bf16 decode's recurrent kernel and the monolithic chunked one may flip a
near-tied greedy pick, so ``test_bf16_hybrid_differences_are_near_ties`` holds every
difference to a near tie, with the top-k logprobs as evidence. Every case must fail its
negative control (a corrupted or skipped block changes the answer or fails the request).
FLASHINFER is not a case: its kernels JIT-compile with nvcc there (no cubins in the
bundle), for more than the 10 minutes a device call has.
``VLLM_FLAGCX_GPU_REPORT=FILE`` writes what each test saw (the closing note's table).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import evidence  # noqa: E402 - tests/gpu, put on the path above

GPU_MEMORY = "0.1"
COMMON = ("--gpu-memory-utilization", GPU_MEMORY, "--kv-cache-memory-bytes", str(2 << 30),
          "--enforce-eager")
HYBRID_KERNELS = ("--gdn-prefill-backend", "triton", "--moe-backend", "triton")
CASES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "sliding-bf16-flash_attn": ("sliding", "bfloat16", ("--attention-backend", "FLASH_ATTN")),
    "sliding-fp32-triton_attn": ("sliding", "float32", ("--attention-backend", "TRITON_ATTN")),
    "hybrid-bf16-triton_attn": ("hybrid", "bfloat16",
                                ("--attention-backend", "TRITON_ATTN", *HYBRID_KERNELS)),
    "hybrid-bf16-flash_attn": ("hybrid", "bfloat16",
                               ("--attention-backend", "FLASH_ATTN", *HYBRID_KERNELS)),
    "mamba2-fp32-triton_attn": ("mamba2", "float32", ("--attention-backend", "TRITON_ATTN")),
}
EXACT = ("sliding-bf16-flash_attn", "sliding-fp32-triton_attn", "mamba2-fp32-triton_attn")
NEAR_TIES = ("hybrid-bf16-flash_attn", "hybrid-bf16-triton_attn")
# A greedy pick may flip between decode (GDN recurrent kernel for the last prompt token)
# and the monolithic run (chunked kernel) only where the monolithic top-2 logits are
# closer than bf16 can tell apart at the head's logit scale (|logit| ~ 16-32: one bf16
# ulp is 0.125-0.25).
NEAR_TIE_NATS = 0.25
FIRST_TOKEN_DRIFT = 8 * evidence.BF16_ULP_AT_4
TOP_K = 20
REPORT: dict[str, Any] = {}


def _report(case: str, key: str, value: Any) -> None:
    REPORT.setdefault(case, {})[key] = value
    path = os.environ.get("VLLM_FLAGCX_GPU_REPORT")
    if path:
        Path(path).write_text(json.dumps(REPORT, indent=1, sort_keys=True))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Every case's prefill + decode + router, started together. A case whose engines do
    not start is recorded with the engine's error; only that case's tests fail."""
    import engines

    from vllm_flagcx.demo import servers as sv

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    deployments = {
        case: engines.Deployment(tmp_path_factory.mktemp(case), kind, dtype,
                                 engine_args=(*COMMON, *args), cpu_isa="auto")
        for case, (kind, dtype, args) in CASES.items()}
    engines_all = [s for d in deployments.values() for s in (d.prefill, d.decode)]
    with sv.running(engines_all):
        ready: dict[str, Any] = {}
        for case, d in deployments.items():
            try:
                took = sv.wait_healthy([d.prefill, d.decode], engines.START_TIMEOUT)
            except sv.DemoError as exc:
                ready[case] = str(exc)
                _report(case, "start_error", str(exc)[-2000:])
                sv.stop_all([d.prefill, d.decode])
                continue
            ready[case] = d
            _report("suite", f"{case}_ready_seconds", round(took, 1))
        routers = [d.router for d in ready.values() if not isinstance(d, str)]
        with sv.running(routers):
            sv.wait_healthy(routers, 60)
            yield ready


def _pair(pairs: dict[str, Any], case: str) -> Any:
    if isinstance(pairs[case], str):
        pytest.fail(f"{case}: the engines did not start: {pairs[case]}")
    return pairs[case]


def _compare(d: Any) -> list[dict[str, Any]]:
    """Per demo prompt: PD's and the monolithic answer, their top-20 logprobs (vLLM's
    default max_logprobs), bytes and seconds of the transfer."""
    import engines

    from vllm_flagcx.demo import run as demo_run

    rows = []
    for prompt in engines.PROMPTS:
        before = demo_run.received(d.decode)
        via_pd = engines.complete(d.router.url, prompt, logprobs=TOP_K)
        assert via_pd.status_code == 200, via_pd.text
        moved, seconds = demo_run.transfer_after(d.decode, before)
        mono = engines.complete(d.prefill.url, prompt, logprobs=TOP_K)
        assert mono.status_code == 200, mono.text
        rows.append({"prompt": prompt[:40], "pd": via_pd.json()["choices"][0],
                     "mono": mono.json()["choices"][0], "moved_bytes": moved,
                     "transfer_ms": round(seconds * 1e3, 3)})
    return rows


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"prompt": r["prompt"], "equal": r["pd"]["text"] == r["mono"]["text"],
             "pd": r["pd"]["text"], "mono": r["mono"]["text"],
             "moved_bytes": r["moved_bytes"], "transfer_ms": r["transfer_ms"]} for r in rows]


def _monolithic_batch_variance(d: Any, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The control for how far this model's bf16 greedy output moves without any
    transfer: the same prompts on the monolithic engine, all at once (with as many filler
    prompts in the batch), against the one-at-a-time answers ``rows`` hold. Where these
    part too, the kernels' rounding alone moves the output that far."""
    from concurrent.futures import ThreadPoolExecutor

    import engines

    prompts = [*engines.PROMPTS, *(p[::-1] for p in engines.PROMPTS)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(
            lambda p: engines.complete(d.prefill.url, p, logprobs=TOP_K), prompts))
    out = []
    for r, answer in zip(rows, answers, strict=False):
        batched = answer.json()["choices"][0]
        diff = evidence.first_difference(batched, r["mono"])
        upto = diff["index"] if diff else len(batched["logprobs"]["tokens"]) - 1
        out.append({"prompt": r["prompt"], "equal": batched["text"] == r["mono"]["text"],
                    "first_difference": diff,
                    "drift_per_position": evidence.drift(batched, r["mono"], upto)})
    return out


@pytest.mark.parametrize("case", EXACT)
def test_pd_greedy_output_equals_monolithic_and_kv_moved(pairs, case):
    rows = _compare(_pair(pairs, case))
    _report(case, "prompts", _summary(rows))
    assert len({r["mono"]["text"] for r in rows}) == len(rows), "outputs must differ by prompt"
    for r in rows:
        assert r["pd"]["text"] == r["mono"]["text"], (case, r["prompt"])
        assert r["moved_bytes"] > 0, (case, r["prompt"], "nothing arrived at decode")


@pytest.mark.parametrize("case", (*EXACT, *NEAR_TIES))
def test_negative_control_corrupted_or_missing_kv_changes_the_answer(pairs, case):
    import engines

    engines.assert_corrupted_kv_changes_the_answer(_pair(pairs, case), engines.PROMPTS)
    _report(case, "negative_control", "passed")


@pytest.mark.parametrize("case", NEAR_TIES)
def test_bf16_hybrid_differences_are_near_ties(pairs, case):
    """The first generated token reads the moved state directly: its distribution must
    equal the monolithic one to within rounding (``FIRST_TOKEN_DRIFT``). Where the greedy
    tokens part, PD's pick must be a near tie in the monolithic run (``NEAR_TIE_NATS``)."""
    d = _pair(pairs, case)
    rows = _compare(d)
    _report(case, "monolithic_batch_variance", _monolithic_batch_variance(d, rows))
    diffs = [evidence.first_difference(r["pd"], r["mono"]) for r in rows]
    drifts = [evidence.drift(r["pd"], r["mono"],
                             diff["index"] if diff else len(r["pd"]["logprobs"]["tokens"]) - 1)
              for r, diff in zip(rows, diffs, strict=True)]
    _report(case, "prompts", _summary(rows))
    _report(case, "first_differences", [d for d in diffs if d is not None])
    _report(case, "drift_per_position", drifts)
    for r, diff, moved in zip(rows, diffs, drifts, strict=True):
        assert r["moved_bytes"] > 0, (r["prompt"], "nothing arrived at decode")
        assert moved[0] <= FIRST_TOKEN_DRIFT, (
            f"{r['prompt']!r}: the first token's logprobs differ by {moved[0]:.3f} nats from "
            "the monolithic run's: the moved state is not the state prefill computed")
        if diff is not None:
            assert diff["gap"] <= NEAR_TIE_NATS, (
                f"{r['prompt']!r}: PD picked {diff['pd_token']!r} where the monolithic "
                f"run's {diff['mono_token']!r} led by {diff['gap']:.3f} nats (drift by "
                f"position {[round(x, 3) for x in moved]}): not a near tie")
