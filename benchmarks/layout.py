"""One generator of the Qwen3.6-35B-A3B per-rank KV layout (TP 8, fp8), for every benchmark.

Facts (``shared/reference/sizing-and-performance.md`` sections 1-2):

* 40 layers = [3 Gated DeltaNet + 1 full attention] x 10. Under vLLM's hybrid KV cache
  manager: 4 KV cache groups of 10 layers (group 0 full attention, groups 1-3 GDN), and
  each of the 10 KV cache tensors is shared by one layer of every group.
* Full attention, 0.34 ``[B, H, N, C]`` layout, fp8: 2 KV heads over 8 ranks (replicated),
  528 tokens x 512 B (K||V, head dim 256) = 270,336 B per block.
* GDN state per layer and rank: conv Q/K/V 256/256/512 channels x 3 rows x 2 B
  (1,536 / 1,536 / 3,072 B), ssm 4 heads x 128 x 128 x 4 B (262,144 B) = 268,288 B in a
  page padded to 270,336 B.
* A request of T tokens holds ceil(T / 528) attention blocks and one state block per GDN
  group (a single-page Mamba cache).

Addresses are synthetic for planning benchmarks (no memory behind them) and real when a
caller passes ``base`` of an allocated pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vllm_flagcx.layout import regions as rg

TP = 8
BLOCK_TOKENS = 528
PAGE = 270_336  # bytes per block in every region (GDN pages padded to it)
FA_LAYERS = 10
GDN_GROUPS = 3
NUM_GROUPS = 1 + GDN_GROUPS
KV_HEADS = 2  # global; TP 8 replicates them
CONV_SPLIT = rg.ConvSplit((("q", 256, 2048), ("k", 256, 2048), ("v", 512, 4096)))
CONV_ROWS, CONV_ELEM = 3, 2
SSM_HEADS, SSM_GLOBAL_HEADS, SSM_HEAD_BYTES = 4, 32, 128 * 128 * 4
GDN_PAGE = 268_288
REQUEST_TOKENS = (1024, 8192, 32768, 40960)
PATTERNS = ("contiguous", "random", "alternating")


def fa_blocks(tokens: int) -> int:
    return math.ceil(tokens / BLOCK_TOKENS)


def request_bytes(tokens: int) -> int:
    """Bytes one rank moves for a request: whole attention pages, GDN pages without their
    padding."""
    return fa_blocks(tokens) * FA_LAYERS * PAGE + GDN_GROUPS * FA_LAYERS * GDN_PAGE


@dataclass(frozen=True)
class RankLayout:
    """One rank's regions over ``num_blocks`` logical blocks (kernel ``ratio`` per block)."""

    regions: list[rg.Region]
    num_blocks: int
    ratio: int
    base: int

    @property
    def tensor_bytes(self) -> int:
        return self.num_blocks * PAGE

    @property
    def pool_bytes(self) -> int:
        return FA_LAYERS * self.tensor_bytes


def rank_layout(num_blocks: int, ratio: int = 1, base: int = 1 << 40) -> RankLayout:
    """Regions of one TP-8 rank: tensor ``i`` (``PAGE * num_blocks`` bytes at
    ``base + i * PAGE * num_blocks``) holds attention layer ``i`` (group 0) and GDN
    layer ``i`` of groups 1-3. ``ratio`` > 1 pages attention finer (FlashInfer 16-token
    kernel blocks: 33 per 528-token block), as vLLM's NIXL path then works."""
    tensor = PAGE * num_blocks
    out: list[rg.Region] = []
    for i in range(FA_LAYERS):
        t_base = base + i * tensor
        out += rg.attention_packed_kv(
            layer=f"layers.{4 * i + 3}.attn", group=0, kind="full_attention", base=t_base,
            block_stride=PAGE // ratio, num_blocks=num_blocks * ratio, heads=1,
            global_heads=KV_HEADS, head_bytes=PAGE // ratio)
        for g in range(1, NUM_GROUPS):
            out += rg.mamba(
                layer=f"layers.{4 * i + g - 1}.gdn", group=g, base=t_base, block_stride=PAGE,
                num_blocks=num_blocks, conv_layout="DS", conv_split=CONV_SPLIT,
                conv_state_len=CONV_ROWS, conv_elem_bytes=CONV_ELEM, ssm_heads=SSM_HEADS,
                ssm_global_heads=SSM_GLOBAL_HEADS, ssm_head_bytes=SSM_HEAD_BYTES,
                page_bytes=GDN_PAGE)
    return RankLayout(out, num_blocks, ratio, base)


def block_ids(tokens: int, num_blocks: int, pattern: str, seed: int = 0
              ) -> list[list[int]]:
    """Per-group logical block ids of one request: ``fa_blocks(tokens)`` attention blocks
    laid out by ``pattern``, and one state block per GDN group (distinct blocks)."""
    n = fa_blocks(tokens)
    if num_blocks < 2 * n + GDN_GROUPS:
        raise ValueError(f"num_blocks={num_blocks} too small for a {tokens}-token request "
                         f"(needs {2 * n + GDN_GROUPS}); raise the pool size")
    rng = np.random.default_rng(seed)
    if pattern == "contiguous":
        fa = np.arange(1, n + 1)
    elif pattern == "random":
        fa = rng.permutation(np.arange(1, num_blocks - GDN_GROUPS))[:n]
    elif pattern == "alternating":
        fa = np.arange(1, 2 * n + 1, 2)
    else:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    used = set(fa.tolist())
    free = [b for b in range(num_blocks - 1, 0, -1) if b not in used][:GDN_GROUPS]
    return [fa.tolist()] + [[b] for b in free]
