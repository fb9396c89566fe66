"""KV cache spec normalisation on real specs and a real hybrid KVCacheConfig."""

from __future__ import annotations

import pytest
import torch
from testkit import vllm_builders
from testkit import vllm_harness as harness

from vllm_flagcx.compat import kv_cache
from vllm_flagcx.compat.kv_cache import SpecKind
from vllm_flagcx.compat.probe import resolve


def test_spec_kinds():
    full = vllm_builders.make_full_attention_spec(block_size=16, num_kv_heads=2, head_size=64,
                                             dtype=torch.bfloat16)
    swa = vllm_builders.make_full_attention_spec(block_size=16, num_kv_heads=2, head_size=64,
                                            dtype=torch.bfloat16, sliding_window=128)
    mla = vllm_builders.make_mla_spec(block_size=16, head_size=576, dtype=torch.bfloat16)
    gdn = vllm_builders.make_mamba_spec(block_size=16, shapes=((3, 256), (4, 32, 32)),
                                   dtypes=(torch.bfloat16, torch.float32))
    assert [kv_cache.spec_kind(s) for s in (full, swa, mla, gdn)] == [
        SpecKind.FULL_ATTENTION, SpecKind.SLIDING_WINDOW, SpecKind.MLA, SpecKind.MAMBA]
    assert full.page_size_bytes == 2 * 16 * 2 * 64 * 2
    assert gdn.page_size_bytes == 3 * 256 * 2 + 4 * 32 * 32 * 4


def test_spec_kind_rejects_unknown():
    with pytest.raises(TypeError, match="unsupported KV cache spec"):
        kv_cache.spec_kind(object())


@pytest.mark.parametrize("name", ["mamba1", "mamba2", "short_conv", "linear_attention",
                                  "gdn_attention"])
def test_mamba_type_round_trip(name, matrix_build):
    spec = vllm_builders.make_mamba_spec(block_size=16, shapes=((3, 8),), dtypes=(torch.float32,),
                                    mamba_type=name)
    assert kv_cache.mamba_type_name(spec) == name
    raw_is_str = type(spec.mamba_type) is str
    assert raw_is_str == (matrix_build.profile["mamba_type"] == "str")


def test_unknown_mamba_type_is_named(matrix_build):
    if matrix_build.profile["mamba_type"] == "str":
        pytest.skip("a str mamba_type accepts any name on this build")
    with pytest.raises(ValueError, match="mamba_type='rwkv'"):
        vllm_builders.make_mamba_spec(block_size=16, shapes=((3, 8),), dtypes=(torch.float32,),
                                 mamba_type="rwkv")


def test_hybrid_config_groups_and_tensors():
    layout = harness.HybridLayout()
    config = harness.hybrid_kv_cache_config(layout)
    assert isinstance(config, resolve("KVCacheConfig"))
    facts = kv_cache.group_facts(config)
    assert [f.kind for f in facts] == [SpecKind.FULL_ATTENTION] + [SpecKind.MAMBA] * 3
    assert {f.mamba_type for f in facts[1:]} == {"gdn_attention"}
    assert len({f.page_size_bytes for f in facts}) == 1  # GDN page padded to attention page
    assert all(f.block_size == layout.block_size for f in facts)
    tensors = kv_cache.kv_cache_tensors(config)
    assert len(tensors) == layout.repeats
    for size, names in tensors:
        assert size == facts[0].page_size_bytes * layout.num_blocks
        assert len(names) == 4  # one attention layer + one layer of each GDN group
    assert kv_cache.has_mamba_groups(config)
    assert not kv_cache.has_mamba_groups(harness.dense_kv_cache_config())
