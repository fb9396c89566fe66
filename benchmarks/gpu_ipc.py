"""GPU data path: the same-host transport (CUDA IPC) P -> D between two processes on one
GPU, against a device-to-device copy of the same bytes measured in the same run.

    python3 benchmarks/gpu_ipc.py [--json OUT.json]

Descriptor sets as in the benchmark plan: 140 / 750 / 20,910 descriptors over the same
178 MB (a 32k-token request); bytes are verified once per set.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

TOTAL = 178_400_000  # one 32k-token request of one rank (the benchmark plan's 178 MB)
SETS = (140, 750, 20910)
REPEATS = 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure()
    print(json.dumps(result["machine"]))
    print(table(result["rows"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def measure(repeats: int = REPEATS) -> dict:
    """Run every descriptor set; {"machine": fingerprint, "rows": [...]}."""
    from testkit import peers

    pool = 2 * TOTAL
    with peers.spawned(peers.gpu_decode_side, pool, start_timeout=120, stop="stop") as (
            conn, (desc, d_base)):
        return _run(conn, desc, d_base, pool, repeats)


def table(rows: list[dict]) -> str:
    lines = [f"{'descriptors':>11} {'MB':>8} {'IPC ms':>8} {'IPC GB/s':>9} {'us/desc':>8} "
             f"{'host-checked GB/s':>18} {'1 memcpy/desc GB/s':>19} {'d2d GB/s':>9} "
             f"{'ratio':>6} {'host us':>8} {'driver us':>9} {'device us':>9}"]
    for r in rows:
        lines.append(f"{r['descriptors']:>11} {r['bytes'] / 1e6:>8.1f} {r['ipc_ms']:>8.2f} "
                     f"{r['ipc_GBps']:>9.1f} {r['us_per_descriptor']:>8.2f} "
                     f"{r.get('host_checked_GBps', 0):>18.1f} "
                     f"{r['memcpy_each_GBps']:>19.1f} {r['d2d_copy_GBps']:>9.1f} "
                     f"{r['ratio']:>6.3f} {r.get('checks_us', 0):>8.1f} "
                     f"{r.get('driver_call_us', 0):>9.1f} {r.get('device_us', 0):>9.1f}")
    return "\n".join(lines)


def _timed(p, handle, s_addr, d_addr, length, kernel: bool, repeats: int,
           host_checks: bool = False) -> list[float]:
    """Wall time of whole writes: the batched kernel or one memcpy per descriptor; with
    ``host_checks`` the kernel path that checks bounds on the host first (the path before
    the checked kernel, and the one machines without it take)."""
    from vllm_flagcx.transport import cuda_ipc
    from vllm_flagcx.transport.local import LocalTransport

    os.environ[cuda_ipc.BATCHED_ENV] = "1" if kernel else "0"
    real = LocalTransport._checks_on_device
    if host_checks:
        LocalTransport._checks_on_device = lambda *_: False  # type: ignore[method-assign]
    out = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            assert p.write(handle, s_addr, d_addr, length).ok
            out.append(time.perf_counter() - start)
    finally:
        LocalTransport._checks_on_device = real  # type: ignore[method-assign]
    return out


def _captured(p, handle, s_addr, d_addr, length) -> tuple:
    """The write up to the driver (IPC mapping, region table; nothing copied): the
    arguments ``copy_checked`` would get (device ordinal, peer addresses, sources,
    lengths, region table, source and destination region counts)."""
    from vllm_flagcx.transport import cuda_ipc

    real = cuda_ipc.CudaDriver.copy_checked
    captured: dict = {}

    def no_copy(self, *args):
        captured["args"] = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)
        return False, False

    cuda_ipc.CudaDriver.copy_checked = no_copy
    try:
        assert p.write(handle, s_addr, d_addr, length).ok
    finally:
        cuda_ipc.CudaDriver.copy_checked = real
    return captured["args"]


def _device_us(lib, stream, launch, repeats: int) -> float:
    """Median device time (CUDA events) of what ``launch`` enqueues on ``stream``."""
    import ctypes

    begin, end = ctypes.c_void_p(), ctypes.c_void_p()
    lib.cuEventCreate(ctypes.byref(begin), 0)
    lib.cuEventCreate(ctypes.byref(end), 0)
    device = []
    for _ in range(repeats):
        lib.cuStreamSynchronize(stream)
        lib.cuEventRecord(begin, stream)
        launch()
        lib.cuEventRecord(end, stream)
        lib.cuStreamSynchronize(stream)
        ms = ctypes.c_float(0)
        lib.cuEventElapsedTime(ctypes.byref(ms), begin, end)
        device.append(ms.value / 1e3)
    return statistics.median(device) * 1e6


def _phases(p, handle, s_addr, d_addr, length, repeats: int) -> dict:
    """Where one write's time goes (medians, us): the host's part (the write with the copy
    switched off: IPC mapping, region table, no pass over the descriptors), the driver
    call (descriptor upload + checked kernel + stream sync, wall), and the device's own
    time for upload + kernel (CUDA events around ``run_checked``; on an idle stream the
    first event fires at once, so the host's staging of the table, ~20 us, counts too, as
    it did in every earlier B2b run)."""
    from vllm_flagcx.transport import cuda_ipc

    cuda = cuda_ipc.driver()
    checks = []
    for _ in range(repeats):
        start = time.perf_counter()
        args = _captured(p, handle, s_addr, d_addr, length)
        checks.append(time.perf_counter() - start)
    call = []
    for _ in range(repeats):
        start = time.perf_counter()
        cuda.copy_checked(*args)
        call.append(time.perf_counter() - start)
    kernel = cuda._kernel(args[0])
    return {"checks_us": statistics.median(checks) * 1e6,
            "driver_call_us": statistics.median(call) * 1e6,
            "device_us": _device_us(cuda.lib, cuda._local.stream,
                                    lambda: kernel.run_checked(cuda._local.stream, *args[1:]),
                                    repeats)}


def _run(conn, desc, d_base, pool, repeats: int) -> dict:
    import torch

    from vllm_flagcx.transport.local import LocalTransport

    src = torch.randint(0, 256, (pool,), dtype=torch.uint8, device="cuda")
    p = LocalTransport()
    p.register(src.data_ptr(), pool)
    t0 = time.perf_counter()
    handle = p.connect(desc)
    rows, tuning = [], {}
    rng = np.random.default_rng(0)
    for n in SETS:
        size = TOTAL // n // 256 * 256
        slots = pool // size
        s_idx = rng.permutation(slots)[:n].astype(np.uint64)
        d_idx = rng.permutation(slots)[:n].astype(np.uint64)
        s_addr = src.data_ptr() + s_idx * np.uint64(size)
        d_addr = d_base + d_idx * np.uint64(size)
        length = np.full(n, size, dtype=np.uint64)
        warm = p.write(handle, s_addr, d_addr, length)  # warm (opens the IPC handle)
        if not warm.ok:
            raise RuntimeError(f"B2b: write failed: {warm.error}")
        conn.send("bytes")
        got = np.frombuffer(conn.recv(), dtype=np.uint8)
        host = src.cpu().numpy()
        for k in rng.choice(n, size=min(n, 32), replace=False):
            a, b = int(s_idx[k]) * size, int(d_idx[k]) * size
            assert np.array_equal(got[b:b + size], host[a:a + size]), "bytes differ"
        per_desc = _timed(p, handle, s_addr, d_addr, length, False, repeats)  # memcpy each
        times = _timed(p, handle, s_addr, d_addr, length, True, repeats)  # one launch
        host_checked = _timed(p, handle, s_addr, d_addr, length, True, repeats, True)
        dst_local = torch.empty(n * size, dtype=torch.uint8, device="cuda")
        base_times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst_local.copy_(src[: n * size])
            torch.cuda.synchronize()
            base_times.append(time.perf_counter() - start)
        moved = n * size
        med, base = statistics.median(times), statistics.median(base_times)
        phases = _phases(p, handle, s_addr, d_addr, length, repeats)
        if n == SETS[-1]:
            tuning = _tuning(p, handle, s_addr, d_addr, length, repeats)
        rows.append({**phases, "descriptors": n, "bytes": moved, "ipc_ms": med * 1e3,
                     "memcpy_each_GBps": moved / statistics.median(per_desc) / 1e9,
                     "ipc_GBps": moved / med / 1e9, "us_per_descriptor": med / n * 1e6,
                     "host_checked_GBps": moved / statistics.median(host_checked) / 1e9,
                     "d2d_copy_GBps": moved / base / 1e9, "ratio": base / med,
                     "p99_ms": max(times) * 1e3})
    fingerprint = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "python": platform.python_version(), "host": platform.node(),
                   "date": time.strftime("%Y-%m-%d")}
    fingerprint["first_connect_s"] = round(time.perf_counter() - t0, 3)
    return {"machine": fingerprint, "rows": rows, "tuning": tuning}


# (threads per block, bytes per warp before a descriptor is split, most blocks in y)
SHAPES = ((256, 8192, 65535), (256, 2048, 65535), (128, 2048, 65535), (256, 8192, 2112),
          (256, 8192, 1056), (256, 8192, 528), (256, 2048, 1056), (512, 8192, 528),
          (128, 8192, 2112), (1024, 8192, 132))


def _tuning(p, handle, s_addr, d_addr, length, repeats: int) -> dict:
    """The checked kernel's launch shape on the largest set (threads per block, bytes per
    warp before a descriptor is split over more warps): device time of upload + kernel."""
    from vllm_flagcx.transport import cuda_ipc, cuda_kernel

    args = _captured(p, handle, s_addr, d_addr, length)
    cuda = cuda_ipc.driver()
    stream = cuda._local.stream
    kernel = cuda._kernel(args[0])
    saved = (cuda_kernel.THREADS, cuda_kernel.WARPS, cuda_kernel.BYTES_PER_SPLIT,
             cuda_kernel.MAX_GRID_Y)
    shapes = []
    try:
        for threads, split_bytes, max_rows in SHAPES:
            cuda_kernel.THREADS, cuda_kernel.WARPS = threads, threads // 32
            cuda_kernel.BYTES_PER_SPLIT, cuda_kernel.MAX_GRID_Y = split_bytes, max_rows
            shapes.append({"threads": threads, "bytes_per_split": split_bytes,
                           "max_rows": max_rows,
                           "device_us": _device_us(
                               cuda.lib, stream,
                               lambda: kernel.run_checked(stream, *args[1:]), repeats)})
    finally:
        (cuda_kernel.THREADS, cuda_kernel.WARPS, cuda_kernel.BYTES_PER_SPLIT,
         cuda_kernel.MAX_GRID_Y) = saved
    return {"shapes": shapes}


def tuning_table(tuning: dict) -> str:
    lines = [f"{'threads':>8} {'split B':>8} {'rows':>6} {'device us':>10}"]
    lines += [f"{r['threads']:>8} {r['bytes_per_split']:>8} {r.get('max_rows', 65535):>6} "
              f"{r['device_us']:>10.1f}"
              for r in tuning.get("shapes", [])]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
