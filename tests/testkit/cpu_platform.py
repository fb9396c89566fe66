"""Run vLLM's real CpuPlatform in test processes (imported before anything imports vLLM).

A CUDA wheel of vLLM on a machine without a GPU resolves ``UnspecifiedPlatform``, whose
``support_hybrid_kv_cache()`` is False, which would silently turn HMA off. The tests run
vLLM's real ``CpuPlatform`` instead (a real vLLM part, chosen, not faked), set before any
vLLM module captures ``current_platform``. Spawned test processes import this first too.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _cpu_platform_class() -> type:
    """vLLM's CpuPlatform; on builds whose x86 CPU config check demands triton-cpu, a
    STAND-IN subclass that satisfies only that check.

    triton-cpu is not on the package registry, so it cannot exist on this machine. The
    stand-in runs CpuPlatform's real ``check_and_update_config`` with ``HAS_TRITON`` seen
    as True for the duration of that one call; no kernel runs in these tests.
    """
    from vllm.platforms.cpu import CpuPlatform

    try:
        import vllm.triton_utils as triton_utils
    except ImportError:
        return CpuPlatform
    if getattr(triton_utils, "HAS_TRITON", True):
        return CpuPlatform

    class CpuPlatformWithoutTritonCpu(CpuPlatform):  # stand-in, see docstring above
        @classmethod
        def check_and_update_config(cls, vllm_config):
            saved = triton_utils.HAS_TRITON
            triton_utils.HAS_TRITON = True
            try:
                return super().check_and_update_config(vllm_config)
            finally:
                triton_utils.HAS_TRITON = saved

    return CpuPlatformWithoutTritonCpu


def _torch_amx_probe_for_older_vllm() -> None:
    """STAND-IN for a torch API that vLLM 0.13's CPU attention calls and the shared test
    base's torch (2.13) no longer has: ``torch._C._cpu._is_amx_tile_supported``. vLLM 0.13
    runs on its own pinned torch in production; the matrix shares one torch across builds.
    The stand-in answers what torch 2.13 itself answers (``torch.cpu``'s probe)."""
    try:
        import torch
    except ImportError:
        return
    cpu = getattr(torch._C, "_cpu", None)
    if cpu is not None and not hasattr(cpu, "_is_amx_tile_supported"):
        cpu._is_amx_tile_supported = lambda: torch.cpu._is_amx_tile_supported()


def _use_cpu_platform() -> None:
    try:
        import vllm.platforms as platforms
    except ImportError:  # the GPU machine runs only the vLLM-free GPU tests
        return

    resolved = getattr(platforms, "_current_platform", None)
    if resolved is not None and type(resolved).__name__ != "UnspecifiedPlatform":
        return  # a real platform was chosen already (a spawned engine's own)
    cpu = _cpu_platform_class()()
    platforms._current_platform = cpu
    if resolved is not None:
        # 0.24+ resolve the platform while ``import vllm`` runs (``vllm.env_override``):
        # the modules that bound the unspecified one get the CPU platform too.
        for module in list(sys.modules.values()):
            if getattr(module, "current_platform", None) is resolved:
                module.current_platform = cpu


_torch_amx_probe_for_older_vllm()
_use_cpu_platform()
