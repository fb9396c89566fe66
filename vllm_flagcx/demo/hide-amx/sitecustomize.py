"""Hides AMX from vLLM in the process this directory is on ``PYTHONPATH`` of.

Put there by ``vllm_flagcx.demo.servers.engine_cpu_isa_env`` for the demo's and the e2e
tests' engine processes only (vLLM's API server, engine core and workers inherit
``PYTHONPATH``). vLLM picks its CPU kernels with ``torch.cpu._is_amx_tile_supported()``
(attention ISA, GDN core, conv-state layout, MoE); answering False selects the vec path,
which runs on every x86 CPU. See that function's docstring for why the demo needs it.
"""

try:
    import torch.cpu
except ImportError:  # not an engine process after all: nothing to hide
    pass
else:
    torch.cpu._is_amx_tile_supported = lambda: False
    _cpu = getattr(torch._C, "_cpu", None)  # what vLLM 0.13's CPU attention asks
    if _cpu is not None and hasattr(_cpu, "_is_amx_tile_supported"):
        _cpu._is_amx_tile_supported = lambda: False
