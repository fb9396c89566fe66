"""B2d: what the integrity checks of one pull cost on host memory, against copying the
request's KV bytes once, timed in the same run.

The caches are Qwen3.6-35B-A3B's attention at TP 1 (10 full-attention layers, 2 KV heads of
256, bfloat16, 16-token blocks, CPU_ATTN's ``(2, B, H, N, D)`` tensors), the request 1,024
or 8,192 tokens. Timed per pull:

* byte sample: the crc32 of 16 descriptor tails of 64 bytes (what prefill computes, and
  decode again over its copy);
* logical sample, prefill: choosing the keys and reading each (layer, block, token, head)
  element through the tensor's indexing, one crc per key (``integrity.logical_sample``);
* logical check, decode: refusing bad keys, the same reads, the comparison
  (``integrity.logical_mismatch``): on the pull's critical path;
* the baseline: copying the request's blocks of every layer (``index_copy_``).

Where CUDA is available the same runs on the GPU (the caches in device memory: the
samples gather on the device and copy a few KiB to the host), once idle and once while
the default stream is busy with an engine-like kernel queue (the logical reads run on a
side stream, so they wait for none of it).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import torch

from benchmarks import report
from vllm_flagcx.compat import kv_views
from vllm_flagcx.connector import integrity
from vllm_flagcx.layout.logical import LayerFacts

LAYERS, HEADS, HEAD_DIM, BLOCK = 10, 2, 256, 16
TOKENS = (1024, 8192)


def _caches(num_blocks: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {f"layers.{4 * i + 3}.attn": torch.randn(2, num_blocks, HEADS, BLOCK, HEAD_DIM,
                                                    device=device).to(torch.bfloat16)
            for i in range(LAYERS)}


def _views(caches: dict[str, torch.Tensor]) -> dict[str, kv_views.AttentionView]:
    return {name: kv_views.AttentionView(kv_views.layer_parts(t, kv_views.SpecKind.FULL_ATTENTION,
                                                              "2BHND"),
                                         LayerFacts(0, BLOCK, HEADS), 1)
            for name, t in caches.items()}


def _busy_default_stream(device: str) -> Any:
    """Queue ~50 ms of matmuls on the default stream (what a running engine does)."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    for _ in range(60):
        a = a @ a
        a = a / a.norm()
    return a


def _measure(tokens: int, reps: int, device: str = "cpu", busy: bool = False
             ) -> dict[str, Any]:
    blocks = tokens // BLOCK
    p, d = _caches(blocks * 2, device), _caches(blocks * 2, device)
    p_ids, d_ids = list(range(0, blocks)), list(range(blocks, 2 * blocks))
    p_views, d_views = _views(p), _views(d)
    index = torch.as_tensor(d_ids, device=device)
    source = torch.as_tensor(p_ids, device=device)

    def copy() -> None:
        for name, t in d.items():
            t.index_copy_(1, index, p[name].index_select(1, source))

    read = integrity.reader(host_memory=device == "cpu")
    assert read is not None

    def prefill(by: integrity.Reader | None = read) -> tuple[integrity.LogicalEntry, ...]:
        return integrity.logical_sample(p_views, [p_ids], [d_ids], [None], 0, 1, 0, 1, by)

    def decode(by: integrity.Reader | None = read) -> str | None:
        return integrity.logical_mismatch(d_views, entries, [d_ids], 0, 1, by)

    def timed(fn: Any, n: int) -> dict[str, float]:
        if not busy:
            return report.summary(report.time_us(fn, n))
        samples = []
        for _ in range(n):  # each read starts while ~50 ms of kernels are queued
            _busy_default_stream(device)
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        return report.summary(samples)

    copy()
    entries = list(prefill())
    assert entries == list(prefill(None)), "the two readers disagree"
    assert decode() is None and decode(None) is None
    tails = [(t.data_ptr() + k * 4096 + 4032, 64) for t in p.values() for k in range(2)][:16]
    per_range = _per_range_reader(device)
    if device != "cpu":
        torch.cuda.synchronize()
    timings = {
        "copy": report.summary(report.time_us(lambda: (copy(), _sync(device)),
                                              max(5, reps // 10))),
        "byte": timed(lambda: integrity.checksum(tails, read), reps),
        # before 9c7cc1b: one synchronous copy per range (the legacy default stream)
        "byte_per_range": timed(lambda: integrity.checksum(tails, per_range), reps),
        "prefill": timed(prefill, reps),
        "decode": timed(decode, reps),
        # before this session: torch's indexing per layer, on a side stream
        "prefill_torch": timed(lambda: prefill(None), reps),
        "decode_torch": timed(lambda: decode(None), reps),
    }
    kv_bytes = sum(t[:, :blocks].numel() * 2 for t in p.values())
    if busy:
        torch.cuda.synchronize()
    return {"device": device + (" (default stream busy)" if busy else ""), "tokens": tokens,
            "kv_bytes": kv_bytes, "keys": len(entries),
            **{f"{k}_us": v for k, v in timings.items()},
            "decode_vs_copy": timings["decode"]["median"] / timings["copy"]["median"]}


def _per_range_reader(device: str) -> integrity.Reader:
    """The byte sample's reader as it was: one synchronous read per range."""
    if device == "cpu":
        return integrity.read_host
    from vllm_flagcx.transport import cuda_ipc

    cuda = cuda_ipc.driver()
    assert cuda is not None

    def read_one(address: int, size: int) -> bytes:  # synchronous, legacy default stream
        cuda.use_device(cuda.device_of(address))
        out = ctypes.create_string_buffer(size)
        rc = cuda.lib.cuMemcpyDtoH_v2(out, ctypes.c_uint64(address), ctypes.c_size_t(size))
        if rc != 0:
            raise RuntimeError(f"cuMemcpyDtoH failed ({rc})")
        return out.raw

    return lambda ranges: [read_one(a, n) for a, n in ranges]


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def run(quick: bool) -> dict[str, Any]:
    reps = 30 if quick else 300
    out = [_measure(tokens, reps) for tokens in TOKENS]
    if torch.cuda.is_available():
        out += [_measure(tokens, reps, "cuda") for tokens in TOKENS]
        out += [_measure(TOKENS[-1], max(10, reps // 10), "cuda", busy=True)]
    rows = [(r["device"], r["tokens"], f"{r['kv_bytes'] / 1e6:.1f}", r["keys"],
             r["copy_us"]["median"], r["byte_us"]["median"], r["byte_per_range_us"]["median"],
             r["prefill_us"]["median"], r["decode_us"]["median"],
             r["prefill_torch_us"]["median"], r["decode_torch_us"]["median"],
             r["decode_vs_copy"]) for r in out]
    text = report.table(
        f"B2d integrity checks of one pull vs copying its KV once (host memory, Qwen3.6 "
        f"attention at TP 1), {reps} reps, medians in us",
        ("device", "tokens", "KV MB", "logical keys", "copy", "byte sample",
         "byte, 1 read/range", "logical prefill", "logical decode",
         "prefill, torch", "decode, torch", "decode / copy"), rows)
    return {"name": "b2d_integrity", "text": text, "rows": out}


def chart(result: dict[str, Any], out_dir: Any) -> None:
    rows = result["rows"]
    report.bar_chart(out_dir, "b2d_integrity", "B2d integrity checks vs one copy",
                     [f"{r['device']} {r['tokens']:,} tokens" for r in rows],
                     {name: [r[f"{key}_us"]["median"] for r in rows]
                      for name, key in (("copy", "copy"), ("byte sample", "byte"),
                                        ("logical prefill", "prefill"),
                                        ("logical decode", "decode"))},
                     "microseconds", log=True)
