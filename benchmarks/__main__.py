"""``python -m benchmarks [--quick] [--only b1,b3] [--out DIR]``: the side-by-side benchmarks.

B1 plan cost per request (vs vLLM NIXL's desc-id code), B2a host data path (vs memcpy),
B3 cost per engine step (real vLLM Scheduler, ours vs NixlConnector's scheduler side),
B4 first-request handshake; where a CUDA GPU is present, B2b (CUDA IPC vs a device-to-device
copy; ``benchmarks/gpu_ipc.py`` runs it alone) and B5 (KV transfer inside real CUDA engines,
``vllm bench serve`` PD vs monolithic). Each prints a machine fingerprint and a table,
writes JSON and a PNG per benchmark to ``--out``. ``--quick`` is a few-minute smoke run
of the harness; its numbers are not the published ones.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

from benchmarks import report

ALL = ("b1_plan", "b2a_host", "b2b_gpu", "b2c_write_checks", "b2d_integrity", "b3_step",
       "b4_handshake", "b5_engines", "b6_preauth_flood", "b7_router_json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--only", default="",
                        help="comma-separated prefixes, e.g. b1,b4 (default: all)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    parser.add_argument("--no-charts", action="store_true")
    args = parser.parse_args(argv)
    wanted = [n for n in ALL if not args.only
              or any(n.startswith(p.strip()) for p in args.only.split(","))]
    if not wanted:
        parser.error(f"--only {args.only!r} matches none of {', '.join(ALL)}")
    machine = report.fingerprint()
    print(json.dumps(machine), flush=True)
    summary = {"machine": machine, "quick": args.quick, "results": {}}
    for name in wanted:
        module = importlib.import_module(f"benchmarks.{name}")
        started = time.monotonic()
        result = module.run(args.quick)
        result["seconds"] = round(time.monotonic() - started, 1)
        print(f"\n{result['text']}\n({name}: {result['seconds']} s)", flush=True)
        report.write_json(args.out, name, {"machine": machine, "quick": args.quick, **result})
        if not args.no_charts:
            module.chart(result, args.out)
        summary["results"][name] = result
    report.write_json(args.out, "summary", summary)
    print(f"\nresults in {args.out}/", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
