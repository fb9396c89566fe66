"""vLLM's CPU kernel classes (``compat.cpu_kernels``), the demo's model choice per class,
the doctor's machine lines and the worker's start line: pure code, no engine."""

from __future__ import annotations

import io

import pytest

from vllm_flagcx import machine_report
from vllm_flagcx.compat import cpu_kernels as ck
from vllm_flagcx.connector.common.worker_setup import start_line
from vllm_flagcx.demo import run as demo_run
from vllm_flagcx.demo import servers as sv
from vllm_flagcx.wire import endpoints

AVX2_ONLY = frozenset({"fpu", "avx", "avx2", "fma"})
BF16 = AVX2_ONLY | {"avx512f", "avx512_bf16"}
AMX = BF16 | {"amx_tile", "amx_bf16"}


def test_flags_are_read_from_cpuinfo_text():
    text = "processor\t: 0\nflags\t\t: fpu avx avx2 fma\n\nprocessor\t: 1\nflags\t: x\n"
    assert ck.cpu_flags(text) == AVX2_ONLY
    assert ck.cpu_flags("processor: 0\n") == frozenset()


@pytest.mark.parametrize(("flags", "native", "reach"), [
    (AVX2_ONLY, "avx2", ["avx2"]),
    (AVX2_ONLY | {"avx512f"}, "avx512", ["avx2", "avx512"]),
    (BF16, "avx512_bf16", ["avx2", "avx512", "avx512_bf16"]),
    (AMX, "amx", ["avx2", "avx512", "avx512_bf16", "amx"]),
    (frozenset({"sse4_2"}), None, []),
])
def test_the_class_and_what_it_reaches(flags, native, reach):
    got = ck.native_class(flags)
    assert (got.name if got else None) == native
    assert [c.name for c in ck.reachable(flags)] == reach


def test_vec_is_the_highest_class_below_amx_and_each_library_is_named():
    assert ck.resolve("vec", AMX) is ck.AVX512_BF16
    assert ck.resolve("vec", AVX2_ONLY) is ck.AVX2
    assert [c.library for c in ck.CLASSES] == ["_C_AVX2", "_C_AVX512", "_C", "_C"]
    with pytest.raises(ck.CpuClassError, match="no AVX2"):
        ck.resolve("vec", frozenset({"sse4_2"}))


def test_engine_env_hides_exactly_the_features_above_the_class():
    hidden = {k.name: ck.engine_env(k)[ck.HIDE_ENV] for k in ck.CLASSES}
    assert hidden == {"avx2": "amx,avx512_bf16,avx512", "avx512": "amx,avx512_bf16",
                      "avx512_bf16": "amx", "amx": ""}
    assert "ATEN_CPU_CAPABILITY" not in ck.engine_env(ck.AVX512_BF16)
    assert ck.engine_env(ck.AVX512)["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    from pathlib import Path

    caches = {ck.engine_env(k, Path("/c"))["VLLM_CACHE_ROOT"] for k in ck.CLASSES}
    assert caches == {f"/c/{k.name}/vllm" for k in ck.CLASSES}  # one compile cache each


def test_process_class_reads_the_mapped_library(monkeypatch):
    monkeypatch.setattr(ck, "loaded_library", lambda: "_C_AVX2")
    assert ck.process_class() == "avx2"
    monkeypatch.setattr(ck, "loaded_library", lambda: None)
    assert ck.process_class() is None


@pytest.mark.parametrize(("kind", "klass", "gpu", "expected"), [
    ("auto", "avx2", False, "sliding"),
    ("auto", "avx512", False, "hybrid"),
    ("auto", "avx512_bf16", False, "hybrid"),
    ("auto", "amx", False, "sliding"),
    ("auto", "avx2", True, "hybrid"),
    ("sliding", "avx2", False, "sliding"),
    ("hybrid", "avx512", False, "hybrid"),
])
def test_the_demo_runs_a_model_its_engines_can_run(kind, klass, gpu, expected):
    chosen, why = demo_run.model_kind_for(kind, klass, gpu)
    assert chosen == expected
    assert bool(why) == (kind == "auto" and expected == "sliding")


def test_the_demo_refuses_what_its_engines_cannot_run_before_starting_them():
    with pytest.raises(sv.DemoError, match=r"hybrid on CPU class avx2.*MoE.*--model-kind "
                                           r"sliding"):
        demo_run.model_kind_for("hybrid", "avx2", False)
    with pytest.raises(sv.DemoError, match="mamba2 needs a GPU"):
        demo_run.model_kind_for("mamba2", "avx512_bf16", False)
    assert demo_run.model_kind_for("mamba2", None, True) == ("mamba2", "")


def test_an_empty_output_is_shown_as_eos():
    assert demo_run.shown("") == "'' (EOS at once)"
    assert demo_run.shown("abc") == "'abc'"


def test_doctor_machine_lines_name_class_library_limits_transport_and_side_channel():
    data = {"cpu": machine_report.cpu_report(AVX2_ONLY), "flagcx": machine_report.flagcx_report(),
            "side_channel": machine_report.side_channel_report()}
    out = io.StringIO()
    machine_report.render(data, out)
    text = out.getvalue()
    assert "class avx2: vLLM's CPU build loads _C_AVX2" in text
    assert "cannot: fp8 KV cache" in text and "MoE" in text
    assert "libflagcx not usable: no libflagcx configured" in text  # none configured in CI
    assert "transport 'auto' would choose local" in text
    assert "127.0.0.1:5600" in text
    assert machine_report.cpu_report(frozenset())["fix"].startswith("no AVX2")


def test_the_worker_start_line_names_transport_address_and_kernel_library(monkeypatch):
    monkeypatch.setattr(ck, "loaded_library", lambda: "_C_AVX512")
    monkeypatch.setenv(ck.HIDE_ENV, "amx,avx512_bf16")
    line = start_line(role="prefill", tp_rank=1, transport="local",
                      advertised_host="10.0.0.5", bind_host="0.0.0.0", port=5601,
                      host_memory=True, secret=True)
    assert "transport local" in line and "side channel on TCP 0.0.0.0:5601" in line
    assert "advertised as 10.0.0.5:5601" in line and "secret set" in line
    assert line.split(" and ", 1)[1].startswith(endpoints.socket_path(5601))
    alone = start_line(role="prefill", tp_rank=0, transport="local", advertised_host="h",
                       bind_host="127.0.0.1", port=5600, host_memory=False, secret=False)
    assert "TCP" not in alone.split("no secret")[0] and "no secret: no TCP port" in alone
    assert "CPU kernel library _C_AVX512 (class avx512; hidden from vLLM: amx, avx512_bf16)" \
        in line
    decode = start_line(role="decode", tp_rank=0, transport="flagcx", advertised_host="x",
                        bind_host="x", port=1, host_memory=False, secret=False)
    assert "CPU kernel" not in decode and "no secret: no TCP port" in decode
