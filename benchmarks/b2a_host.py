"""B2a: host data path, prefill -> decode between two processes over the same-host transport
(``process_vm_writev``), against a single-thread memcpy of the same bytes in the same run.

The request's descriptors come from the planner (B1's inputs) over real pools: contiguous
block ids (coalesced: 10 attention runs + 30 GDN pages) and random ones (one descriptor
per block). Bytes are verified once per size by a crc over the receiver's ranges.
"""

from __future__ import annotations

import ctypes
import zlib
from typing import Any

import numpy as np

from benchmarks import layout as L
from benchmarks import peer, report, use_test_helpers
from vllm_flagcx.layout import plans
from vllm_flagcx.transport.local import LocalTransport


def run(quick: bool) -> dict[str, Any]:
    sizes = (1024, 8192) if quick else (1024, 8192, 32768)
    reps = 5 if quick else 20
    num_blocks = 2 * L.fa_blocks(max(sizes)) + L.GDN_GROUPS + 2
    p_pool = np.random.default_rng(0).integers(0, 256, L.FA_LAYERS * num_blocks * L.PAGE,
                                               dtype=np.uint8)
    p_side = L.rank_layout(num_blocks, base=p_pool.ctypes.data)
    baseline_dst = np.zeros(L.request_bytes(max(sizes)), dtype=np.uint8)
    out, rows = [], []
    use_test_helpers()
    from testkit import peers

    with peers.spawned(peer.host_pool, p_pool.nbytes, start_timeout=120, stop="stop") as (
            conn, (desc, d_base)):
        d_side = L.rank_layout(num_blocks, base=d_base)
        transport = LocalTransport()
        transport.register(p_pool.ctypes.data, p_pool.nbytes)
        handle = transport.connect(desc)
        for tokens in sizes:
            nbytes = L.request_bytes(tokens)
            memcpy = report.summary(report.time_us(
                lambda n=nbytes: ctypes.memmove(baseline_dst.ctypes.data, p_pool.ctypes.data,
                                                n), reps))
            for pattern in ("contiguous", "random"):
                plan = plans.plan_transfer(
                    p_side.regions, d_side.regions,
                    L.block_ids(tokens, num_blocks, pattern, seed=3),
                    L.block_ids(tokens, num_blocks, pattern, seed=4),
                    plans.RankPair(0, L.TP, 0, L.TP))
                assert plan.num_bytes == nbytes

                def write(plan=plan):
                    result = transport.write(handle, plan.src, plan.dst, plan.length)
                    assert result.ok, result.error

                timing = report.summary(report.time_us(write, reps, warmup=1))
                ranges = list(zip(plan.dst.tolist(), plan.length.tolist(), strict=True))
                conn.send(("crc", ranges))
                want = 0
                for addr, length in zip(plan.src.tolist(), plan.length.tolist(), strict=True):
                    want = zlib.crc32(ctypes.string_at(addr, length), want)
                if conn.recv() != want:
                    raise AssertionError(f"B2a: bytes differ at decode ({tokens}, {pattern})")
                gbps = nbytes / timing["median"] / 1e3
                base_gbps = nbytes / memcpy["median"] / 1e3
                entry = {"tokens": tokens, "pattern": pattern, "bytes": nbytes,
                         "descriptors": plan.num_descriptors, "write_us": timing,
                         "memcpy_us": memcpy, "GBps": gbps, "memcpy_GBps": base_gbps,
                         "ratio": gbps / base_gbps}
                out.append(entry)
                rows.append((tokens, pattern, nbytes / 1e6, plan.num_descriptors,
                             timing["median"] / 1e3, gbps, base_gbps, gbps / base_gbps))
    text = report.table(
        f"B2a host data path, P -> D between two processes (process_vm_writev), {reps} reps",
        ("tokens", "block ids", "MB", "descs", "ms p50", "GB/s", "memcpy GB/s",
         "ratio"), rows)
    return {"name": "b2a_host", "text": text, "rows": out}


def chart(result: dict[str, Any], out_dir: Any) -> None:
    rows = result["rows"]
    labels = [f"{r['tokens'] // 1024}k {r['pattern'][:4]} ({r['descriptors']} d)"
              for r in rows]
    report.bar_chart(out_dir, "b2a_host", "B2a host P->D vs single-thread memcpy", labels,
                     {"same-host transport": [r["GBps"] for r in rows],
                      "memcpy (same run)": [r["memcpy_GBps"] for r in rows]}, "GB/s")
