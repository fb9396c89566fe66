"""Puts the engine process this directory is on ``PYTHONPATH`` of on a lower x86 class.

Put there by ``vllm_flagcx.demo.servers.engine_cpu_isa_env`` for the demo's and the e2e
tests' engine processes only (vLLM's API server, engine core and workers inherit
``PYTHONPATH`` and the environment). ``FLAGCX_HIDE_CPU_FEATURES`` lists the features to
hide (``amx``, ``avx512_bf16``, ``avx512``); each torch probe vLLM asks for it then answers
False, so vLLM loads the kernel library of the class below
(``vllm_flagcx.compat.cpu_kernels`` says which, and why the demo hides AMX by default).
Standard library and torch only: it runs before anything else in the process.
"""

import os

_HIDDEN = {f for f in os.environ.get("FLAGCX_HIDE_CPU_FEATURES", "amx").split(",") if f}
_PROBES = {"amx": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported",
           "avx512": "_is_avx512_supported"}

try:
    import torch.cpu
except ImportError:  # not an engine process after all: nothing to hide
    pass
else:
    _cpu = getattr(torch._C, "_cpu", None)  # what vLLM 0.13's CPU attention asks
    for _feature in _HIDDEN & set(_PROBES):
        _name = _PROBES[_feature]
        setattr(torch.cpu, _name, lambda: False)
        if _cpu is not None and hasattr(_cpu, _name):
            setattr(_cpu, _name, lambda: False)
