"""Attention wrappers against the real selector and layout helpers of the installed vLLM."""

from __future__ import annotations

import pytest
import torch
import vllm_harness as harness

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
    dropped = attention.dropped_attn_backend_kwargs(ARGS_013)
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
