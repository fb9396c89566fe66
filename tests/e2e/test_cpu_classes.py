"""The demo flow on vLLM's other CPU kernel libraries, reached on this machine by hiding
the features above them from vLLM in the engine processes (``compat.cpu_kernels``).

The other e2e modules run the engines on the machine's own class below AMX (``vec``);
this one runs the lowest class, AVX2 (``_C_AVX2``), whatever the machine, and with
``VLLM_FLAGCX_E2E_CPU_CLASSES=all`` every other class the CPU reaches. Each run names the
library its engines loaded from their own start line (read from ``/proc/self/maps`` in
the worker), so a run on the wrong path cannot pass; the model is what the class can run
(``demo.run.model_kind_for``: the sliding model on AVX2, whose library cannot run the
hybrid's MoE layer). Then prefill on AVX2 and decode restarted on the machine's own class:
the same bytes move (both use vLLM's ``vec`` attention cache) and the answer is right.
"""

from __future__ import annotations

import os

import engines
import pytest

from vllm_flagcx.compat import cpu_kernels
from vllm_flagcx.demo import run as demo
from vllm_flagcx.demo import servers as sv

pytestmark = pytest.mark.skipif(os.environ.get("VLLM_FLAGCX_E2E") != "1",
                                reason="needs the e2e env (a CPU build of vLLM)")


def classes_to_run() -> list[str]:
    """AVX2 and, with ``VLLM_FLAGCX_E2E_CPU_CLASSES=all``, every other class below AMX
    this CPU reaches, except the default engines' own (the other modules run it)."""
    flags = cpu_kernels.cpu_flags()
    own = demo.engine_class("vec") if cpu_kernels.native_class(flags) else None
    wanted = [c.name for c in cpu_kernels.reachable(flags) if c is not cpu_kernels.AMX]
    if os.environ.get("VLLM_FLAGCX_E2E_CPU_CLASSES") != "all":
        wanted = wanted[:1]
    return [c for c in wanted if c != own]


CLASSES = classes_to_run() if os.environ.get("VLLM_FLAGCX_E2E") == "1" else []


@pytest.fixture(scope="module", params=CLASSES or [None])
def lower_class(request, tmp_path_factory):
    if request.param is None:
        pytest.skip("this CPU's own class is the lowest (AVX2): the other e2e modules "
                    "run it")
    kind, _ = demo.model_kind_for("auto", request.param, False)
    with engines.deployed(tmp_path_factory.mktemp(f"e2e-{request.param}"), kind,
                          cpu_isa=request.param) as d:
        yield request.param, d


def test_engines_load_the_library_of_their_class(lower_class):
    name, d = lower_class
    library = cpu_kernels.BY_NAME[name].library
    for server, role in ((d.prefill, "prefill"), (d.decode, "decode")):
        line = engines.started_line(server, role)
        assert f"CPU kernel library {library} (class {name}" in line, line


def test_pd_equals_monolithic_on_that_library(lower_class):
    _, d = lower_class
    engines.assert_pd_equals_monolithic(d)
    assert engines.distinct_outputs(d) == len(engines.PROMPTS)


def test_negative_control_on_that_library(lower_class):
    _, d = lower_class
    engines.assert_corrupted_kv_changes_the_answer(d, engines.PROMPTS[2:])


def test_prefill_and_decode_on_two_libraries_move_the_same_bytes(lower_class):
    """Decode restarted on the machine's own class (prefill stays on the lower one): the
    handshake accepts the pair (same ``vec`` attention cache format, no refusal), KV
    arrives, and decode's answer is prefill's monolithic one (float32 with the demo
    model's wide logit margins: the libraries' matmul rounding does not flip a greedy
    pick; decode's own monolithic answer is no reference, its prefix cache holds the
    moved KV)."""
    name, d = lower_class
    own = sv.engine_cpu_isa_env("vec")
    for key in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", cpu_kernels.HIDE_ENV,
                "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        d.decode.env.pop(key, None)
    d.decode.env.update(own)
    d.restart(d.decode)
    own_library = cpu_kernels.BY_NAME[demo.engine_class("vec") or "avx2"].library
    assert f"CPU kernel library {own_library}" in engines.started_line(d.decode, "decode")
    failed_before = engines.failures(d.decode)
    # KV arrives for every prompt decode continues (one whose answer is prefill's first
    # token moves none), and the answers equal prefill's own
    engines.assert_pd_equals_monolithic(d)
    assert engines.failures(d.decode) == failed_before, f"{name} -> own class"
