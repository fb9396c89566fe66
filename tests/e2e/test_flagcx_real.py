"""The REAL FlagCX library, built here from ``third_party/flagcx`` (``tests/flagcx_real.py``:
every source file compiled, only the CUDA driver replaced by a stand-in), loaded through
the project's binding.

Checked, each in a child process (a crash there fails the test instead of killing it):
every symbol the binding calls resolves; the version reads as every release reports it
(10000); a failure reads "failed" with FlagCX's constant error string; the transport
refuses to create an engine on a host without an RDMA device, naming the fix (the real
engine would be created, and its first registration would segfault with libibverbs
installed); without libibverbs the engine is not created and the error says so.

In the e2e env: the NCCL headers and library come from its nvidia-nccl wheel. Elsewhere,
or without a toolchain, it skips naming what is missing.
"""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from testkit import flagcx_real

from vllm_flagcx.transport import flagcx as fx

CHECK = """
import json, sys
from pathlib import Path
from vllm_flagcx.transport import flagcx as fx
lib = fx.FlagCXLibrary(Path(sys.argv[1]))
out = {"version": lib.version, "optional": sorted(lib.optional),
       "error": lib.error(fx.FACADE_FAILED), "rdma": fx.rdma_devices()}
try:
    fx.FlagCXTransport(lib)
    out["refused"] = None
except fx.FlagCXLoadError as exc:
    out["refused"] = str(exc)
if sys.argv[2] == "create-without-ibverbs":
    try:
        fx.FlagCXTransport(lib, rdma_sysfs=None).close()
        out["created"] = "created"
    except fx.TransportError as exc:
        out["created"] = str(exc)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def real_library() -> Path:
    try:
        return flagcx_real.build(flagcx_real.REPO / ".tox" / "flagcx-real")
    except flagcx_real.BuildUnavailable as exc:
        pytest.skip(f"cannot build the real FlagCX here: {exc}")


def _check(lib: Path, mode: str = "") -> dict:
    out = subprocess.run([sys.executable, "-c", CHECK, str(lib), mode], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, f"crashed or failed ({out.returncode}): {out.stderr[-2000:]}"
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.split(" ", 1)[1])


def test_real_library_loads_through_the_binding(real_library):
    result = _check(real_library)
    assert result["version"] == "flagcxGetVersion 10000 (1.0.0)"
    assert result["error"].startswith("failed (returned -1")
    assert "Not implemented." in result["error"]
    print(f"\nreal FlagCX: {result['version']}, optional symbols {result['optional']}")


def test_no_rdma_device_is_refused_with_the_fix_never_a_crash(real_library):
    result = _check(real_library)
    if result["rdma"]:
        pytest.skip(f"this host has RDMA devices {result['rdma']}")
    assert "no RDMA device" in result["refused"]
    assert "transport='local'" in result["refused"]


@pytest.mark.skipif(ctypes.util.find_library("ibverbs") is not None,
                    reason="libibverbs is installed: the real engine would be created and "
                           "its first registration would crash (refused by the RDMA check)")
def test_without_ibverbs_the_engine_is_not_created_and_that_is_an_error(real_library):
    result = _check(real_library, "create-without-ibverbs")
    assert "EngineCreate returned NULL" in result["created"]


def test_every_symbol_the_binding_calls_is_exported(real_library):
    lib = ctypes.CDLL(str(real_library))
    assert [name for name in fx.SYMBOLS if not hasattr(lib, name)] == []
