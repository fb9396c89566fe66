"""What every benchmark prints and writes: machine fingerprint, timing stats, a table, JSON,
and one PNG chart (matplotlib, when installed)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def fingerprint() -> dict[str, Any]:
    """Cores, CPU model, Python, and the vLLM / torch builds the numbers came from."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor()
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
                           "cpu": cpu, "cores": os.cpu_count(),
                           "python": platform.python_version()}
    for module in ("vllm", "torch", "numpy"):
        try:
            out[module] = __import__(module).__version__
        except Exception:  # a fingerprint never fails the run
            out[module] = None
    return out


def not_run_without_cuda(name: str, title: str) -> dict[str, Any] | None:
    """The result of a GPU benchmark that cannot run here (no torch or no CUDA device), or
    None when a CUDA device is present."""
    try:
        import torch

        if torch.cuda.is_available():
            return None
    except ImportError:
        pass
    return {"name": name, "text": f"{title}: not run (no CUDA device)", "rows": []}


def time_us(fn: Callable[[], Any], reps: int, warmup: int = 3) -> list[float]:
    """Wall microseconds of ``reps`` calls (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - start) / 1e3)
    return out


def summary(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"median": statistics.median(ordered), "p99": p99, "n": len(ordered)}


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A fixed-width table (numbers right-aligned, 3 significant decimals at most)."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = [title, "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def write_json(out_dir: Path, name: str, payload: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def bar_chart(out_dir: Path, name: str, title: str, labels: Sequence[str],
              series: dict[str, Sequence[float]], ylabel: str, log: bool = False
              ) -> Path | None:
    """Grouped bars, one group per label, one bar per series; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"({name}.png not drawn: matplotlib is not installed)")
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(labels) * len(series)), 4.2))
    width = 0.8 / max(1, len(series))
    for k, (label, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, values, width=width, label=label)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
