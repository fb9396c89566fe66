"""Build the REAL libflagcx.so from the snapshot in ``third_party/flagcx`` (FlagCX main,
Apache-2.0), CPU-only, for tests that load it through the project's binding.

What the build needs and where it comes from (no registry at build time):
- g++ and make (the machine's toolchain);
- CUDA headers and libcudart: ``CUDA_HOME`` or /usr/local/cuda (the toolkit this machine
  kind carries), else the ``nvidia/cu13`` wheels when they hold complete headers;
- NCCL headers and library: the ``nvidia-nccl`` wheel of the same env;
- the CUDA *driver* (libcuda.so.1), which only a GPU machine has: replaced by a small
  STAND-IN (``flagcx_standin/cuda_driver_standin.c``) whose every entry point answers
  CUDA_ERROR_NO_DEVICE. It is the only stand-in; every FlagCX source file is compiled.

``make USE_NVIDIA=1 COMPILE_KERNEL=0 FORCE_DEFAULT_PATH=1`` (no device kernels, FlagCX's
default device-API backend), as on the GPU machine. The result is cached by the snapshot's
hash, so a second run costs nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = REPO / "third_party" / "flagcx" / "flagcx-src.tar.gz"
DRIVER_STANDIN = Path(__file__).resolve().parents[1] / "flagcx_standin" / "cuda_driver_standin.c"


class BuildUnavailable(RuntimeError):
    """What this machine lacks to build the real library (the tests skip with it)."""


def _wheel_dir(package: str) -> Path | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:  # the parent package (nvidia) is not installed at all
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _cuda_home() -> Path:
    """CUDA headers that compile (``crt/host_config.h`` included: the runtime wheel alone
    lacks it) and a libcudart."""
    wheel = _wheel_dir("nvidia.cu13")
    for candidate in (os.environ.get("CUDA_HOME"), "/usr/local/cuda", wheel):
        if candidate and (Path(candidate) / "include" / "crt" / "host_config.h").exists():
            return Path(candidate)
    raise BuildUnavailable("no complete CUDA headers (CUDA_HOME, /usr/local/cuda or the "
                           "nvidia-cuda-runtime + nvcc wheels)")


def _libdir(home: Path) -> Path:
    for name in ("lib", "lib64"):
        if list((home / name).glob("libcudart.so*")):
            return home / name
    raise BuildUnavailable(f"no libcudart under {home}")


def _nccl_home() -> Path:
    wheel = _wheel_dir("nvidia.nccl")
    if wheel is None or not (wheel / "include" / "nccl.h").exists():
        raise BuildUnavailable("no NCCL (the nvidia-nccl wheel): run in the e2e env")
    return wheel


def _real_driver() -> Path:
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/local/nvidia/lib64", "/usr/lib64",
                   "/usr/local/cuda/lib64/stubs"):
        for name in ("libcuda.so.1", "libcuda.so"):
            if (Path(folder) / name).exists():
                return Path(folder) / name
    raise BuildUnavailable("no CUDA driver (libcuda.so.1) on this machine")


def prepare(root: Path, driver_standin: bool = True) -> dict[str, Path]:
    """Lay out DEVICE_HOME and CCL_HOME the Makefile expects under ``root``: headers and
    libraries linked from the wheels, the driver stand-in compiled next to them (or, on a
    GPU machine, ``driver_standin=False``: the real driver linked there)."""
    for tool in ("g++", "gcc", "make"):
        if shutil.which(tool) is None:
            raise BuildUnavailable(f"{tool} is not installed")
    cuda, nccl = _cuda_home(), _nccl_home()
    device, ccl = root / "device", root / "ccl"
    for d in (device / "lib64", ccl / "lib"):
        d.mkdir(parents=True, exist_ok=True)
    for link, target in ((device / "include", cuda / "include"),
                         (ccl / "include", nccl / "include")):
        if not link.exists():
            link.symlink_to(target)
    libs = [*_libdir(cuda).glob("libcudart.so*"), *(nccl / "lib").glob("libnccl.so*")]
    for lib in libs:
        for name in {lib.name, lib.name.split(".so")[0] + ".so"}:
            for folder in (device / "lib64", ccl / "lib"):
                if not (folder / name).exists():
                    (folder / name).symlink_to(lib)
    driver = ccl / "lib" / "libcuda.so.1"
    if driver_standin:
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                        str(driver), str(DRIVER_STANDIN)], check=True, timeout=120)
    elif not driver.exists():
        driver.symlink_to(_real_driver())
    for folder in (device / "lib64", ccl / "lib"):
        if not (folder / "libcuda.so").exists():
            (folder / "libcuda.so").symlink_to(driver)
    return {"device": device, "ccl": ccl}


def build(cache: Path, timeout: float = 1500, driver_standin: bool = True) -> Path:
    """``libflagcx.so`` built from the snapshot under ``cache`` (reused when present)."""
    if not SNAPSHOT.exists():
        raise BuildUnavailable(f"{SNAPSHOT} is missing")
    digest = hashlib.sha256(SNAPSHOT.read_bytes() + DRIVER_STANDIN.read_bytes()).hexdigest()
    root = cache / (digest[:16] + ("" if driver_standin else "-driver"))
    lib = root / "FlagCX" / "build" / "lib" / "libflagcx.so"
    if lib.exists():
        return lib
    homes = prepare(root, driver_standin)
    with tarfile.open(SNAPSHOT) as tar:
        tar.extractall(root, filter="data")
    jobs = str(max(1, len(os.sched_getaffinity(0))))
    out = subprocess.run(
        ["make", "-j", jobs, "USE_NVIDIA=1", "COMPILE_KERNEL=0", "FORCE_DEFAULT_PATH=1",
         f"DEVICE_HOME={homes['device']}", f"CCL_HOME={homes['ccl']}"],
        cwd=root / "FlagCX", capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0 or not lib.exists():
        raise RuntimeError(f"building libflagcx failed (exit {out.returncode}):\n"
                           f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return lib
