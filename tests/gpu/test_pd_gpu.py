"""PD == monolithic on a real CUDA vLLM: prefill + decode engines on one GPU, FlagCXConnector
over CUDA IPC (the same-host transport), the router in front; per attention backend.

Needs a CUDA GPU and a CUDA build of vLLM (skipped elsewhere; CI has neither). On the lent
H200 with ``../shared/gpu-vllm``'s bundle::

    VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/site:$PWD \\
        python3 -m pytest -m gpu tests/gpu -v

Every pair is started at once (one GPU, ``GPU_MEMORY`` of it each) so the suite fits in a
device call, in vLLM's default CUDA graph mode (``VLLM_FLAGCX_GPU_EAGER=1``: eager);
``VLLM_FLAGCX_GPU_CASES=a,b`` starts only those cases. Cases that must give
the monolithic answer token for token, with bytes moved: the sliding + full model on
FLASH_ATTN (bf16, (2, num_blocks, ...) layout) and TRITON_ATTN (float32, (num_blocks, 2,
...) layout), and the Mamba2 hybrid (Nemotron-H layer mix: Mamba2 conv + ssm state with the
attention KV) in float32 on TRITON_ATTN. The Qwen3-Next-style hybrid (Gated DeltaNet) runs
in bf16 only: vLLM 0.22's CUDA GDN prefill kernel refuses float32
(``ChunkGatedDeltaRuleFunction does not support float32``), and in bf16 decode's
recompute of the last prompt token rounds differently from the monolithic chunked run, so
greedy picks part now and then on both backends; ``test_bf16_hybrid_differences_are_rounding``
holds the typical logprob drift to the rounding level instead, and its own negative
control shows a corrupted block exceeds it. Every case must fail its negative control (a
corrupted or skipped block changes the answer or fails the request). FLASHINFER is not a
case: its kernels JIT-compile with nvcc there (no cubins in the bundle), for more than the
10 minutes a device call has.
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
from testkit import evidence  # noqa: E402

GPU_MEMORY = "0.1"
# vLLM's default mode (CUDA graphs, torch.compile) as users run it; VLLM_FLAGCX_GPU_EAGER=1
# is the --enforce-eager variant (faster engine start)
COMMON = ("--gpu-memory-utilization", GPU_MEMORY, "--kv-cache-memory-bytes", str(2 << 30),
          *(("--enforce-eager",) if os.environ.get("VLLM_FLAGCX_GPU_EAGER") == "1" else ()))
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
BF16_HYBRID = ("hybrid-bf16-flash_attn", "hybrid-bf16-triton_attn")
# The bf16 hybrid's criterion and its numbers: testkit/evidence.py (ROUNDING_NATS); the
# checks themselves: tests/e2e/engines.py, shared with the CPU e2e tests.
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
    chosen = [c for c in os.environ.get("VLLM_FLAGCX_GPU_CASES", "").split(",") if c]
    unknown = set(chosen) - set(CASES)
    if unknown:
        raise pytest.UsageError(f"VLLM_FLAGCX_GPU_CASES names unknown cases {sorted(unknown)};"
                                f" known: {sorted(CASES)}")
    deployments = {
        case: engines.Deployment(tmp_path_factory.mktemp(case), kind, dtype,
                                 engine_args=(*COMMON, *args), cpu_isa="auto")
        for case, (kind, dtype, args) in CASES.items() if not chosen or case in chosen}
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
    if case not in pairs:
        pytest.skip(f"{case} not in VLLM_FLAGCX_GPU_CASES")
    if isinstance(pairs[case], str):
        pytest.fail(f"{case}: the engines did not start: {pairs[case]}")
    return pairs[case]


def _compare(d: Any) -> list[dict[str, Any]]:
    import engines

    return engines.logprob_rows(d, list(engines.PROMPTS))


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
            lambda p: engines.complete(d.prefill.url, p, logprobs=evidence.TOP_K), prompts))
    out = []
    for r, answer in zip(rows, answers, strict=False):
        batched = answer.json()["choices"][0]
        out.append({"prompt": r["prompt"], "equal": batched["text"] == r["mono"]["text"],
                    **evidence.parting(batched, r["mono"]).record()})
    return out


@pytest.mark.parametrize("case", EXACT)
def test_pd_greedy_output_equals_monolithic_and_kv_moved(pairs, case):
    rows = _compare(_pair(pairs, case))
    _report(case, "prompts", _summary(rows))
    assert len({r["mono"]["text"] for r in rows}) == len(rows), "outputs must differ by prompt"
    for r in rows:
        assert r["pd"]["text"] == r["mono"]["text"], (case, r["prompt"])
        assert r["moved_bytes"] > 0, (case, r["prompt"], "nothing arrived at decode")


@pytest.mark.parametrize("case", (*EXACT, *BF16_HYBRID))
def test_negative_control_corrupted_or_missing_kv_changes_the_answer(pairs, case):
    import engines

    engines.assert_corrupted_kv_changes_the_answer(_pair(pairs, case), engines.PROMPTS)
    _report(case, "negative_control", "passed")


@pytest.mark.parametrize("case", BF16_HYBRID)
def test_bf16_hybrid_differences_are_rounding(pairs, case):
    """Until PD's greedy tokens part from the monolithic ones (and at the parting), the
    typical (median) divergence per position stays at the rounding level
    (``evidence.ROUNDING_NATS``): the moved state is the state prefill computed. Where
    they part, the gap and both top-k are recorded."""
    import engines

    d = _pair(pairs, case)
    rows = _compare(d)
    _report(case, "monolithic_batch_variance", _monolithic_batch_variance(d, rows))
    _report(case, "prompts", _summary(rows))
    _report(case, "logprobs", [{"pd": r["pd"]["logprobs"], "mono": r["mono"]["logprobs"]}
                               for r in rows])
    readings = engines.pd_readings(rows)
    _report(case, "readings", readings)
    engines.assert_pd_within_rounding(readings)


@pytest.mark.parametrize("case", BF16_HYBRID)
def test_bf16_hybrid_corrupted_block_drifts_beyond_rounding(pairs, case):
    """The negative control of the criterion above: one corrupted block must push the
    median divergence over ``ROUNDING_NATS`` or fail the request, for every prompt."""
    import engines

    readings = engines.corrupted_readings(_pair(pairs, case), list(engines.PROMPTS))
    _report(case, "corrupted_block", readings)
    engines.assert_corrupted_beyond_rounding(readings)
