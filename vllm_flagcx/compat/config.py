"""Config reads that survive renamed/removed fields and env names.

* ``vllm.envs.X`` raises AttributeError for names a release removed (e.g.
  ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` in 0.22), so our knobs are read from ``os.environ``.
* ``kv_ip/kv_rank/kv_parallel_size/kv_buffer_size`` are forbidden in 0.34's KVTransferConfig:
  never required, always read with a default.
* DP index: ``data_parallel_index`` (0.17+) or ``data_parallel_rank``.
* Resumed (preempted, rescheduled) requests: ``scheduled_cached_reqs.resumed_req_ids``
  (<= 0.22) or "appears in ``scheduled_new_reqs`` again" (0.34).
"""

from __future__ import annotations

import os
from typing import Any

from vllm_flagcx.compat.capabilities import capabilities
from vllm_flagcx.compat.probe import resolve

_MISSING = object()


def env(name: str, default: str | None = None) -> str | None:
    """An environment knob, read directly (vllm.envs may not know it on this build)."""
    return os.environ.get(name, default)


def kv_transfer_field(kv_transfer_config: Any, name: str, default: Any = None) -> Any:
    """A KVTransferConfig field that some builds lack (kv_ip, kv_rank, ...)."""
    value = getattr(kv_transfer_config, name, _MISSING)
    return default if value is _MISSING or value is None else value


def dp_index(parallel_config: Any) -> int:
    if capabilities().dp_index_field == "data_parallel_index":
        return int(getattr(parallel_config, "data_parallel_index", 0) or 0)
    return int(getattr(parallel_config, "data_parallel_rank", 0) or 0)


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 where no TP group is initialised)."""
    try:
        return int(resolve("get_tensor_model_parallel_rank")())
    except (AssertionError, AttributeError, RuntimeError):
        return 0


def gdn_conv_split(hf_config: Any, tp_size: int) -> Any | None:
    """The [Q | K | V] conv channel split of a Gated DeltaNet layer on one rank."""
    from vllm_flagcx.layout.regions import ConvSplit

    text = getattr(hf_config, "text_config", hf_config)
    try:
        key = int(text.linear_num_key_heads) * int(text.linear_key_head_dim)
        value = int(text.linear_num_value_heads) * int(text.linear_value_head_dim)
    except (AttributeError, TypeError):
        return None
    return ConvSplit((("q", key // tp_size, key), ("k", key // tp_size, key),
                      ("v", value // tp_size, value)))
