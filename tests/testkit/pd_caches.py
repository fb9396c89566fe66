"""KV caches as vLLM lays them out, on the CPU: each model's per-rank ``KVCacheConfig``
(hybrid GDN + attention, dense, sliding + full, MLA), and random-filled tensors viewed the
way each attention backend family and vLLM's hybrid restride view them (``allocate``).
``pd_harness`` builds instances over them and re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from testkit import backend_layouts, vllm_builders
from testkit import vllm_harness as harness
from vllm_flagcx.compat import kv_cache

KV_HEADS, HEAD_DIM, BLOCK = 2, 256, 16
KEY_DIM, VALUE_DIM, SSM_HEADS, SSM_DIM, CONV_WIDTH = 64, 128, 4, 32, 3


@dataclass
class RankCaches:
    config: Any  # the rank's KVCacheConfig (per-rank specs)
    raw: list[torch.Tensor]
    caches: dict[str, Any]
    attention_dims: str = "2BNHD"  # the attention caches' logical dimensions


def rank_kv_cache_config(tp: int, num_blocks: int, repeats: int = 2,
                         conv_layout: str = "SD") -> Any:
    """The KVCacheConfig one TP rank of the tiny hybrid sees (heads and channels / tp)."""
    heads = max(1, KV_HEADS // tp)
    attention = vllm_builders.make_full_attention_spec(block_size=BLOCK, num_kv_heads=heads,
                                                  head_size=HEAD_DIM, dtype=torch.bfloat16)
    page = attention.page_size_bytes
    conv_dim = (2 * KEY_DIM + VALUE_DIM) // tp
    conv_shape = (CONV_WIDTH, conv_dim) if conv_layout == "SD" else (conv_dim, CONV_WIDTH)
    gdn = vllm_builders.make_mamba_spec(block_size=BLOCK,
                                   shapes=(conv_shape,
                                           (SSM_HEADS // tp, SSM_DIM, SSM_DIM)),
                                   dtypes=(torch.bfloat16, torch.float32),
                                   mamba_type="gdn_attention", page_size_padded=page)
    layout = harness.HybridLayout(repeats=repeats, num_blocks=num_blocks)
    gdn_groups = [layout.gdn_layers[i::3] for i in range(3)]
    groups = [(layout.attention_layers, attention)] + [(n, gdn) for n in gdn_groups]
    tensors = [(page * num_blocks, [layout.attention_layers[r]] + [g[r] for g in gdn_groups])
               for r in range(repeats)]
    return vllm_builders.make_kv_cache_config(num_blocks=num_blocks, groups=groups, tensors=tensors)


DENSE_HEAD_DIM = 64


def dense_rank_kv_cache_config(tp: int, num_blocks: int, layers: int = 2,
                               dtype: Any = torch.bfloat16) -> Any:
    heads = max(1, KV_HEADS // tp)
    spec = vllm_builders.make_full_attention_spec(block_size=BLOCK, num_kv_heads=heads,
                                             head_size=DENSE_HEAD_DIM, dtype=dtype)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return vllm_builders.make_kv_cache_config(
        num_blocks=num_blocks, groups=[(names, spec)],
        tensors=[(spec.page_size_bytes * num_blocks, [n]) for n in names])


SLIDING_WINDOW = 32  # tokens: 2 blocks, so prompts of 100+ tokens leave it far behind


def sliding_rank_kv_cache_config(tp: int, num_blocks: int, layers: int = 2) -> Any:
    """Sliding-window + full attention (2 KV cache groups under HMA, Gemma/Mistral style):
    layer 0 full, the rest sliding, each layer its own tensor."""
    heads = max(1, KV_HEADS // tp)
    common = dict(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD_DIM,
                  dtype=torch.bfloat16)
    full = vllm_builders.make_full_attention_spec(**common)
    sliding = vllm_builders.make_full_attention_spec(**common, sliding_window=SLIDING_WINDOW)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return vllm_builders.make_kv_cache_config(
        num_blocks=num_blocks, groups=[(names[:1], full), (names[1:], sliding)],
        tensors=[(full.page_size_bytes * num_blocks, [n]) for n in names])


MLA_HEAD = 576  # kv_lora_rank 512 + rope 64, DeepSeek-style latent


def mla_rank_kv_cache_config(tp: int, num_blocks: int, layers: int = 2) -> Any:
    """MLA: every rank holds the whole latent (replicated across TP)."""
    spec = vllm_builders.make_mla_spec(block_size=BLOCK, head_size=MLA_HEAD, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return vllm_builders.make_kv_cache_config(
        num_blocks=num_blocks, groups=[(names, spec)],
        tensors=[(spec.page_size_bytes * num_blocks, [n]) for n in names])


# Single-group attention caches as each backend family declares them (vLLM 0.22's
# get_kv_cache_shape and get_kv_cache_stride_order): the physical order, and the
# permutation to the logical shape vLLM hands to register_kv_caches.
ATTN_LAYOUTS = {
    # FLASH_ATTN / FLEX_ATTENTION / ROCm: (2, B, N, H, D), HND stride order
    "flash_hnd": ("2BHND", (0, 1, 3, 2, 4)),
    # FLASHINFER with its HND stride order: (B, 2, N, H, D) stored (B, 2, H, N, D)
    "flashinfer_hnd": ("B2HND", (0, 1, 3, 2, 4)),
    # TRITON_ATTN, FLASHINFER NHD: (B, 2, N, H, D) stored as declared
    "triton_nhd": ("B2NHD", (0, 1, 2, 3, 4)),
    # and every backend class this vLLM imports, from its own shape and stride order
    **backend_layouts.backend_layouts(),
}


def declared_dims_of(layout: str) -> str:
    """The logical dimensions (``compat.attention.declared_dims`` letters) of a layout."""
    physical, perm = ATTN_LAYOUTS[layout]
    return "".join(physical[i] for i in perm)


def layout_declaring(dims: str | None, default: str = "flash_hnd") -> str:
    """A layout of ``ATTN_LAYOUTS`` whose logical dimensions are ``dims`` (a backend's own
    first), ``default`` when none is or ``dims`` is None."""
    names = sorted(ATTN_LAYOUTS, key=lambda n: not n.startswith("backend:"))
    return next((n for n in names if declared_dims_of(n) == dims), default)


def _attention_cache(raw: Any, dtype: Any, nb: int, h: int, n: int, dim: int,
                     layout: str) -> Any:
    physical, perm = ATTN_LAYOUTS[layout]
    sizes = {"2": 2, "B": nb, "H": h, "N": n, "D": dim}
    return raw.view(dtype).view(*(sizes[c] for c in physical)).permute(*perm)


def allocate(config: Any, conv_layout: str, seed: int, kernel_ratio: int = 1,
             attn_layout: str = "flash_hnd") -> RankCaches:
    """Random-filled caches viewed as vLLM does (one int8 buffer per KVCacheTensor)."""
    gen = torch.Generator().manual_seed(seed)
    specs = {n: g.kv_cache_spec for g in config.kv_cache_groups for n in g.layer_names}
    raws, caches = [], {}
    # the attention caches' logical dimensions; a hybrid views its pages blocks-first:
    # as declared for CPU_ATTN and the NHD family, restrided to (2, B, N, H, D) otherwise
    dims = declared_dims_of(attn_layout)
    if len(config.kv_cache_groups) > 1 and attn_layout != "triton_nhd" and dims != "2BHND":
        dims = "2BNHD"
    for size, names in kv_cache.kv_cache_tensors(config):
        raw = torch.randint(-128, 127, (size,), dtype=torch.int8, generator=gen)
        raws.append(raw)
        nb = config.num_blocks
        for name in names:
            spec = specs[name]
            page = spec.page_size_bytes
            if kv_cache.spec_kind(spec) is kv_cache.SpecKind.MAMBA:
                conv_shape, ssm_shape = spec.shapes  # storage order of the conv layout
                conv = torch.as_strided(raw.view(torch.bfloat16), (nb, *conv_shape),
                                        (page // 2, conv_shape[1], 1))
                conv_bytes = conv_shape[0] * conv_shape[1] * 2
                ssm = torch.as_strided(raw.view(torch.float32), (nb, *ssm_shape),
                                       (page // 4, ssm_shape[1] * ssm_shape[2], ssm_shape[2],
                                        1), storage_offset=conv_bytes // 4)
                caches[name] = [conv, ssm]
            elif kv_cache.spec_kind(spec) is kv_cache.SpecKind.MLA:
                caches[name] = raw.view(torch.bfloat16).view(nb, BLOCK, spec.head_size)
            elif len(config.kv_cache_groups) == 1:  # one backend family's own layout
                # vLLM allocates num_blocks * ratio kernel blocks of BLOCK // ratio tokens
                caches[name] = _attention_cache(raw, spec.dtype, nb * kernel_ratio,
                                                spec.num_kv_heads, BLOCK // kernel_ratio,
                                                spec.head_size, attn_layout)
            elif dims == "2BHND":  # hybrid on CPU_ATTN: (2, B, H, N, D) over vLLM's
                # blocks-first restride
                h = spec.num_kv_heads
                phys = raw.view(torch.bfloat16).view(nb, 2, h, BLOCK, HEAD_DIM)
                caches[name] = phys.permute(1, 0, 2, 3, 4)
            elif attn_layout == "triton_nhd":  # hybrid, (B, 2, N, H, D) as declared: vLLM
                # skips its restride for this family (already blocks-first)
                h = spec.num_kv_heads
                caches[name] = raw.view(torch.bfloat16).view(nb, 2, BLOCK, h, HEAD_DIM)
            else:  # hybrid: attention restrided blocks-first so pages line up with GDN
                h = spec.num_kv_heads
                phys = raw.view(torch.bfloat16).view(nb, 2, h, BLOCK, HEAD_DIM)
                caches[name] = phys.permute(1, 0, 3, 2, 4)  # logical (2, B, N, H, D)
    return RankCaches(config, raws, caches, dims)
