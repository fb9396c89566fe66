"""Attention wrappers against the real selector and layout helpers of the installed vLLM."""

from __future__ import annotations

import inspect

import pytest
import torch
from testkit import vllm_harness as harness

from vllm_flagcx.compat import attention
from vllm_flagcx.compat.probe import resolve

# The argument set a 0.13-era connector passes (block_size included).
ARGS_013 = dict(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
                use_mla=False, has_sink=False, use_sparse=False)


@pytest.fixture(scope="module")
def dense_config():
    return harness.make_vllm_config()


def test_get_attn_backend_with_013_arguments(dense_config, matrix_build):
    with resolve("set_current_vllm_config")(dense_config):
        backend = attention.get_attn_backend(**ARGS_013)
    assert isinstance(backend, type) and issubclass(backend, resolve("AttentionBackend"))
    params = inspect.signature(resolve("get_attn_backend")).parameters
    dropped = {k for k in ARGS_013 if k not in params}  # what this build would ignore
    if matrix_build.profile["attn_backend_block_size"] == "absent":
        assert "block_size" in dropped  # a positional call would have bound it to use_mla
    else:
        assert "block_size" not in dropped


def test_get_attn_backend_ignores_unknown_kwargs(dense_config):
    with resolve("set_current_vllm_config")(dense_config):
        a = attention.get_attn_backend(**ARGS_013)
        b = attention.get_attn_backend(**ARGS_013, has_sliding_window=False, num_heads=4,
                                       use_per_head_quant_scales=False, not_a_kwarg=1)
    assert a is b


def test_current_attn_backends_is_a_list(dense_config):
    backends = attention.current_attn_backends(dense_config)
    assert isinstance(backends, list) and len(backends) == 1
    assert issubclass(backends[0], resolve("AttentionBackend"))


def test_kv_layout(dense_config, matrix_build):
    layout = attention.kv_layout(dense_config)
    if matrix_build.profile["kv_layout"] == "get_kv_cache_layout":
        assert layout in {"NHD", "HND"}
    else:
        # 0.34: resolved by the engine core; unresolved here, or an enum name.
        assert layout is None or layout in {"HND", "NHD", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}


def test_required_layout_name():
    assert attention.required_kv_layout_name(is_mla=False) == "HND"
    assert attention.required_kv_layout_name(is_mla=True) is None


def test_cache_format_names_the_cpu_isa_so_an_amx_vec_pair_is_refused(monkeypatch):
    """vLLM's CPU attention pre-packs its cache on AMX (same shapes, other byte order):
    measured, a prefill with AMX hidden and a decode with AMX moved 3 MB, passed the
    integrity check and answered wrong. The format is read the way vLLM picks the ISA
    (bf16, block 32), and a pair that differs is refused naming the field and both
    values."""
    import torch

    from vllm_flagcx.compat.attention import cache_format
    from vllm_flagcx.wire import handshake as hs

    config = harness.make_vllm_config(block_size=32)
    layers = ["model.layers.0.self_attn.attn"]
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    vec = cache_format(config, layers, 32, 64)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    amx = cache_format(config, layers, 32, 64)
    assert "unknown" not in vec and "layout=" in vec
    if "isa=" not in vec:
        pytest.skip(f"this build's CPU attention has no ISA choice ({vec})")
    assert "isa=vec" in vec and "isa=amx" in amx

    def sheet(fmt: str, engine: str) -> hs.FactSheet:
        layout = hs.LayoutFacts(model="m", dtype="bfloat16", kv_cache_dtype="auto",
                                group_kinds=("full_attention",), block_sizes=(32,),
                                kernel_block_sizes=(32,), page_bytes=(8192,),
                                conv_layout="", num_kv_heads=2, cache_format=fmt)
        return hs.make_sheet(layout=layout, engine_id=engine, incarnation="1", tp_size=1,
                             tp_rank=0)

    with pytest.raises(hs.HandshakeError) as refused:
        hs.check_compatible(sheet(vec, "decode-engine"), sheet(amx, "prefill-engine"))
    message = str(refused.value)
    assert "cache_format" in message and vec in message and amx in message
    assert "decode-engine" in message and "prefill-engine" in message
    hs.check_compatible(sheet(vec, "decode-engine"), sheet(vec, "prefill-engine"))


def test_cache_format_carries_the_dimensions_the_backend_declares():
    """The handshake's layout facts name what regions were read from: the backend's own
    declared dimensions (two sides whose backends declare other dimensions are refused at
    the handshake by the cache_format comparison, before any plan)."""
    from vllm_flagcx.compat.attention import cache_format, current_attn_backends, declared_dims

    config = harness.make_vllm_config(block_size=32)
    layers = ["model.layers.0.self_attn.attn"]
    fmt = cache_format(config, layers, 32, 64)
    declared = {declared_dims(b) for b in current_attn_backends(config, layers)} - {None}
    if not declared:
        pytest.skip(f"this build's backend declares no per-block K/V layout ({fmt})")
    for dims in declared:
        assert f"dims={dims}" in fmt
        assert set(dims) == set("2BNHD")
