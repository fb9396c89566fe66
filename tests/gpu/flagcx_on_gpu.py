"""On the GPU machine: build the REAL FlagCX (CUDA flavour, the machine's real driver)
from ``third_party/flagcx`` and load it through the binding (issue 16, item 5).

    python3 tests/gpu/flagcx_on_gpu.py OUT_JSON

Prints and writes: build time, version, optional symbols, the no-RDMA refusal, and what
the real engine does past our check (engine create with the check off, then one
registration of a CUDA tensor, each in a child process so a crash is recorded, not
suffered). Not a pytest module: it needs a GPU and records facts for the closing note.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from testkit import flagcx_real

PAST_THE_CHECK = """
import sys, torch
from pathlib import Path
from vllm_flagcx.transport import flagcx as fx
lib = fx.FlagCXLibrary(Path(sys.argv[1]))
t = fx.FlagCXTransport(lib, rdma_sysfs=None)
print("ENGINE created", flush=True)
x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
t.register(x.data_ptr(), x.numel())
print("REGISTERED", flush=True)
"""


def main(out: str) -> int:
    from vllm_flagcx.transport import flagcx as fx

    started = time.monotonic()
    lib_path = flagcx_real.build(Path("/tmp/flagcx-real"), driver_standin=False)
    facts: dict[str, object] = {"build_seconds": round(time.monotonic() - started, 1),
                                "library": str(lib_path)}
    lib = fx.FlagCXLibrary(lib_path)
    facts |= {"version": lib.version, "optional": sorted(lib.optional),
              "error_text": lib.error(fx.FACADE_FAILED), "rdma_devices": fx.rdma_devices()}
    try:
        fx.FlagCXTransport(lib).close()
        facts["our_check"] = "passed (RDMA device present)"
    except fx.FlagCXLoadError as exc:
        facts["our_check"] = f"refused: {exc}"
    child = subprocess.run([sys.executable, "-c", PAST_THE_CHECK, str(lib_path)],
                           capture_output=True, text=True, timeout=120)
    facts["past_the_check"] = {"returncode": child.returncode,
                               "stdout": child.stdout[-800:], "stderr": child.stderr[-800:]}
    print(json.dumps(facts, indent=2))
    Path(out).write_text(json.dumps(facts, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
