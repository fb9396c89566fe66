"""B2d: what the full logical digest of one pull costs, against copying the request's
KV and state bytes once, timed in the same run.

The caches are Qwen3.6-35B-A3B's at TP 1: 10 full-attention layers (2 KV heads of 256,
bfloat16, 16-token blocks, ``(2, B, N, H, D)``) and 30 Gated DeltaNet layers (conv state
8,192 channels x 3 in bfloat16, ssm state 32 heads x 128 x 128 in float32, one block per
request), the request 1,024 or 8,192 tokens (32,768 too on a GPU). Timed per pull:

* prefill: the digest of everything it writes (``integrity.sender_digests``), before its
  reply;
* decode: its own digest and the comparison (``integrity.receiver_mismatch``), on the
  pull's critical path;
* the baseline: copying the request's blocks of every layer once (``index_copy_``).

The budget (issue 36): <= 1 ms per MB on a 2-core CPU; on an H100 / H200 <= 0.2 ms at 1k
tokens and <= 1 ms at 32k per side. Where CUDA is available the same runs on the GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks import report
from vllm_flagcx.compat import kv_views
from vllm_flagcx.compat.kv_cache import SpecKind
from vllm_flagcx.connector.common import integrity

LAYERS, GDN_LAYERS, HEADS, HEAD_DIM, BLOCK = 10, 30, 2, 256, 16
SECTIONS = (("q", 2048, 2048), ("k", 2048, 2048), ("v", 4096, 4096))
CONV_STATE, SSM_HEADS, SSM_DIM = 3, 32, 128
TOKENS = (1024, 8192)
GPU_TOKENS = (1024, 8192, 32768)


def _caches(num_blocks: int, device: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        f"layers.{4 * i + 3}.attn": torch.randn(2, num_blocks, BLOCK, HEADS, HEAD_DIM,
                                                device=device).to(torch.bfloat16)
        for i in range(LAYERS)}
    for i in range(GDN_LAYERS):
        out[f"layers.{i + i // 3}.linear_attn"] = [
            torch.randn(8, CONV_STATE, 8192, device=device).to(torch.bfloat16),
            torch.randn(8, SSM_HEADS, SSM_DIM, SSM_DIM, device=device)]
    return out


def _views(caches: dict[str, Any]) -> dict[str, kv_views.LayerView]:
    views = {}
    for name, t in caches.items():
        if isinstance(t, list):
            views[name] = kv_views.LayerView(1, kv_views.state_parts(t, None, "SD", SECTIONS,
                                                                     0, 1))
        else:
            k, v = kv_views.layer_parts(t, SpecKind.FULL_ATTENTION, "2BNHD")
            views[name] = kv_views.LayerView(0, (kv_views.Part("k", k, 0, HEADS),
                                                 kv_views.Part("v", v, 0, HEADS)))
    return views


def _measure(tokens: int, reps: int, device: str) -> dict[str, Any]:
    blocks = tokens // BLOCK
    p, d = _caches(blocks * 2, device), _caches(blocks * 2, device)
    p_ids = [list(range(blocks)), [1]]
    d_ids = [list(range(blocks, 2 * blocks)), [5]]
    p_views, d_views = _views(p), _views(d)
    index = torch.as_tensor(d_ids[0], device=device)
    source = torch.as_tensor(p_ids[0], device=device)

    def copy() -> None:
        for name, t in d.items():
            if isinstance(t, list):
                for mine, theirs in zip(t, p[name], strict=True):
                    mine[5].copy_(theirs[1])
            else:
                t.index_copy_(1, index, p[name].index_select(1, source))
        _sync(device)

    def prefill() -> tuple[tuple[str, int], ...]:
        paired = integrity.paired_sender_ids(p_ids, d_ids, [0, None])
        return integrity.sender_digests(p_views, paired, (0, 1), (0, 1))

    copy()
    sent = prefill()
    assert len(sent) == LAYERS + GDN_LAYERS

    def decode() -> str | None:
        return integrity.receiver_mismatch(d_views, sent, d_ids, (0, 1), (0, 1))

    assert decode() is None, "the copy and its digest disagree"
    timings = {"copy": report.summary(report.time_us(copy, max(5, reps // 4))),
               "prefill": report.summary(report.time_us(prefill, reps)),
               "decode": report.summary(report.time_us(decode, reps))}
    attention = sum(t[:, :blocks].numel() * 2 for t in p.values() if not isinstance(t, list))
    state = GDN_LAYERS * (8192 * CONV_STATE * 2 + SSM_HEADS * SSM_DIM * SSM_DIM * 4)
    megabytes = (attention + state) / 1e6
    return {"device": device, "tokens": tokens, "attention_mb": attention / 1e6,
            "state_mb": state / 1e6, **{f"{k}_us": v for k, v in timings.items()},
            "decode_ms_per_mb": timings["decode"]["median"] / 1e3 / megabytes,
            "decode_vs_copy": timings["decode"]["median"] / timings["copy"]["median"]}


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def run(quick: bool) -> dict[str, Any]:
    reps = 5 if quick else 30
    out = [_measure(tokens, reps, "cpu") for tokens in TOKENS]
    if torch.cuda.is_available():
        out += [_measure(tokens, reps * 4, "cuda") for tokens in GPU_TOKENS]
    rows = [(r["device"], r["tokens"], f"{r['attention_mb']:.1f}", f"{r['state_mb']:.1f}",
             r["copy_us"]["median"], r["prefill_us"]["median"], r["decode_us"]["median"],
             f"{r['decode_ms_per_mb']:.3f}", r["decode_vs_copy"]) for r in out]
    text = report.table(
        f"B2d full logical digest of one pull vs copying its bytes once (Qwen3.6-35B-A3B at "
        f"TP 1: 10 attention + 30 GDN layers), {reps} reps, medians in us",
        ("device", "tokens", "KV MB", "state MB", "copy", "digest prefill",
         "digest + compare decode", "decode ms/MB", "decode / copy"), rows)
    return {"name": "b2d_integrity", "text": text, "rows": out}


def chart(result: dict[str, Any], out_dir: Any) -> None:
    rows = result["rows"]
    report.bar_chart(out_dir, "b2d_integrity", "B2d full digest vs one copy",
                     [f"{r['device']} {r['tokens']:,} tokens" for r in rows],
                     {name: [r[f"{key}_us"]["median"] for r in rows]
                      for name, key in (("copy", "copy"), ("digest prefill", "prefill"),
                                        ("digest decode", "decode"))},
                     "microseconds", log=True)
