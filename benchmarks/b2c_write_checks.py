"""B2c: what one GPU write costs on the CPU before the copy starts, on the same-host
transport: the bounds checks of both sides and the mapping of peer addresses into this
process's CUDA IPC mappings (``LocalTransport._write_device`` up to ``copy_batch``), per
descriptor count (B2b's 140 / 750 / 20,910) and number of peer allocations (1: B2b's one
pool; 40: a real engine's per-layer KV tensors), against the bare mapping arithmetic
(``dst + delta``, one numpy pass) timed in the same run; and the same write given the
plan's span hints (``TransferPlan.dst_span``: which peer allocation each descriptor is in,
checked by gathers instead of a binary search per descriptor; issue 27).

At 20,910 descriptors this CPU time is of the order of the H200's copy itself (176 MB at
~1.7 TB/s is ~0.1 ms), so it bounds B2b's rate there. Where the batched kernel is built, a
write of ``BATCH_MIN`` descriptors or more now checks bounds in the kernel instead
(``LocalTransport._write_checked``); this host pass remains for fewer descriptors, for
machines without NVRTC and for peers with more regions than the kernel holds.

STAND-IN: ``_DriverStandIn`` replaces the CUDA driver (this runs without a GPU): it
answers a mapping base per IPC handle and does not copy. B2b times the copy on the GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks import report
from vllm_flagcx.transport import cuda_ipc
from vllm_flagcx.transport import local as lt

DESCRIPTOR_BYTES = 8448  # B2b's 20,910-descriptor case: 176.6 MB
SETS = (140, 750, 20910)
ALLOCATIONS = (1, 40)


class _DriverStandIn:
    """The two driver calls ``_write_device`` makes; no GPU behind them."""

    def open(self, handle: bytes, device: int) -> int:
        return 0x7000_0000_0000 + int.from_bytes(handle, "little") * (1 << 36)

    def copy_batch(self, device: int, dst: np.ndarray, src: np.ndarray,
                   length: np.ndarray) -> None:
        return None

    def has_kernel(self, device: int) -> bool:
        """No kernel: the host-checked path, the one this benchmark times."""
        return False


def _pair(allocations: int, n: int) -> tuple[lt.LocalTransport, Any, np.ndarray, np.ndarray,
                                             np.ndarray, np.ndarray]:
    """This process's one pool and a peer's ``allocations`` pools, with ``n`` descriptors
    spread evenly over the peer's pools in order (as a plan lists layers)."""
    me = lt.LocalTransport()
    mine = 0x10_0000_0000
    me.device_ranges = [lt._DeviceRange(mine, n * DESCRIPTOR_BYTES, mine, b"me", 0)]
    me._device_table = lt._device_table(me.device_ranges)
    per = -(-n // allocations)
    size = per * DESCRIPTOR_BYTES
    bases = [0x20_0000_0000 + k * (size + (1 << 21)) for k in range(allocations)]
    peer = lt._Peer(1, (), tuple(lt._DeviceRange(b, size, b, k.to_bytes(2, "little"), 0)
                                 for k, b in enumerate(bases)))
    index = np.arange(n)
    src = np.uint64(mine) + index.astype(np.uint64) * np.uint64(DESCRIPTOR_BYTES)
    dst = (np.array(bases, dtype=np.uint64)[index // per]
           + (index % per).astype(np.uint64) * np.uint64(DESCRIPTOR_BYTES))
    return me, peer, src, dst, np.full(n, DESCRIPTOR_BYTES, np.uint64), index // per


def run(quick: bool) -> dict[str, Any]:
    reps = 50 if quick else 400
    original = cuda_ipc.driver
    cuda_ipc.driver = _DriverStandIn  # type: ignore[assignment]
    rows, out = [], []
    try:
        for allocations in ALLOCATIONS:
            for n in SETS:
                me, peer, src, dst, length, hint = _pair(allocations, n)
                assert me._write_device(peer, src, dst, length).ok
                assert me._write_device(peer, src, dst, length, None, hint).ok
                write = report.summary(report.time_us(
                    lambda m=me, p=peer, s=src, d=dst, n=length: m._write_device(p, s, d, n),
                    reps))
                hinted = report.summary(report.time_us(
                    lambda m=me, p=peer, s=src, d=dst, n=length, h=hint:
                    m._write_device(p, s, d, n, None, h), reps))
                bare = report.summary(report.time_us(lambda d=dst: d + np.uint64(12345), reps))
                entry = {"allocations": allocations, "descriptors": n, "write_us": write,
                         "hinted_us": hinted, "bare_us": bare,
                         "ratio": write["median"] / bare["median"],
                         "hinted_over_search": hinted["median"] / write["median"],
                         "ns_per_descriptor": write["median"] * 1e3 / n}
                out.append(entry)
                rows.append((allocations, n, write["median"], write["p99"], hinted["median"],
                             entry["hinted_over_search"], bare["median"], entry["ratio"],
                             entry["ns_per_descriptor"]))
    finally:
        cuda_ipc.driver = original  # type: ignore[assignment]
    text = report.table(
        f"B2c CPU cost of one GPU write before the copy (checks + IPC mapping; CUDA driver "
        f"stand-in), {reps} reps",
        ("peer allocations", "descriptors", "write us p50", "p99", "with span hints us",
         "hinted / searched", "bare dst+delta us", "ratio", "ns/desc"), rows)
    checks, check_rows = _plan_checks(reps)
    text += "\n\n" + report.table(
        f"B2c' prefill's bounds check of a plan (bounds.check_within, both sides, "
        f"{STORAGES} storages each), {reps} reps",
        ("descriptors", "searched us p50", "with span hints us p50", "hinted / searched"),
        check_rows)
    return {"name": "b2c_write_checks", "text": text, "rows": out, "plan_checks": checks}


STORAGES = 40  # a real engine's per-layer KV tensors


def _plan_checks(reps: int) -> tuple[list[dict[str, Any]], list[tuple[Any, ...]]]:
    """``check_within`` on plans without and with span hints (same descriptors)."""
    from vllm_flagcx.layout import bounds, plans

    spans = [(k * 10_000_000, 5_000_000) for k in range(STORAGES)]
    rng = np.random.default_rng(0)
    out, rows = [], []
    for n in SETS:
        k = rng.integers(0, STORAGES, n)
        addr = (k * 10_000_000 + rng.integers(0, 4_000_000, n)).astype(np.uint64)
        length = np.full(n, DESCRIPTOR_BYTES, np.uint64)
        bare = plans.TransferPlan(addr, addr.copy(), length)
        named = plans.TransferPlan(addr, addr.copy(), length, k, k.copy())
        searched = report.summary(report.time_us(
            lambda p=bare: bounds.check_within(p, spans, spans), reps))
        hinted = report.summary(report.time_us(
            lambda p=named: bounds.check_within(p, spans, spans), reps))
        ratio = hinted["median"] / searched["median"]
        out.append({"descriptors": n, "searched_us": searched, "hinted_us": hinted,
                    "hinted_over_searched": ratio})
        rows.append((n, searched["median"], hinted["median"], ratio))
    return out, rows


def chart(result: dict[str, Any], out_dir: Any) -> None:
    rows = result["rows"]
    labels = [f"{r['allocations']} alloc, {r['descriptors']:,} desc" for r in rows]
    report.bar_chart(out_dir, "b2c_write_checks", "B2c CPU cost of a GPU write before the copy",
                     labels, {"write (us p50)": [r["write_us"]["median"] for r in rows],
                              "with span hints (us p50)": [r["hinted_us"]["median"]
                                                           for r in rows],
                              "bare dst+delta (us p50)": [r["bare_us"]["median"] for r in rows]},
                     "microseconds", log=True)
