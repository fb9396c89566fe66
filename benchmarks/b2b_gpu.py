"""B2b: GPU data path, CUDA IPC P -> D between two processes on one GPU, against a
device-to-device copy of the same bytes in the same run (``benchmarks/gpu_ipc.py``).

Needs a CUDA GPU; elsewhere (CI, the CPU VM) it reports itself as not run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from benchmarks import report, use_test_helpers

HERE = Path(__file__).resolve().parent


def run(quick: bool) -> dict[str, Any]:
    skipped = report.not_run_without_cuda("b2b_gpu", "B2b GPU data path")
    if skipped is not None:
        return skipped
    use_test_helpers()
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import gpu_ipc

    result = gpu_ipc.measure(repeats=5 if quick else gpu_ipc.REPEATS)
    text = (f"B2b GPU data path on {result['machine']['gpu']} (CUDA IPC vs device-to-device "
            f"copy in the same run)\n" + gpu_ipc.table(result["rows"])
            + "\nthe kernel's launch shape at the largest set (device time of one "
              "launch)\n" + gpu_ipc.tuning_table(result["tuning"]))
    return {"name": "b2b_gpu", "text": text, **result}


def chart(result: dict[str, Any], out_dir: Any) -> None:
    rows = result["rows"]
    if not rows:
        return
    report.bar_chart(out_dir, "b2b_gpu", "B2b CUDA IPC P->D vs device-to-device copy",
                     [f"{r['descriptors']:,} descriptors" for r in rows],
                     {"IPC, batched kernel": [r["ipc_GBps"] for r in rows],
                      "IPC, one memcpy each": [r["memcpy_each_GBps"] for r in rows],
                      "d2d copy (same run)": [r["d2d_copy_GBps"] for r in rows]}, "GB/s")
