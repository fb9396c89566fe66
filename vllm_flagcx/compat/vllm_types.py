"""What the connector reads of vLLM's objects, as Protocols: vLLM's own classes are not
importable where the connector's types are checked (and differ per build), so the
boundary names the attributes it relies on instead of ``Any`` (every build 0.13-0.34
has them; ``tests/test_vllm_hooks.py`` and the PD tests pass vLLM's real ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class VllmRequest(Protocol):
    """vLLM's ``Request`` as the scheduler half uses it (``compat.vllm_writes`` writes more)."""

    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int
    kv_transfer_params: object  # the client's (a dict, or anything through vllm_xargs)
    status: object  # RequestStatus: read by its .name


class KVCacheGroupLike(Protocol):
    """One of ``KVCacheConfig.kv_cache_groups``: its layers share a spec and block ids."""

    layer_names: list[str]
    kv_cache_spec: Any  # a KVCacheSpec subclass (its fields differ per build and kind)


class KVCacheTensorLike(Protocol):
    """One backing tensor: its size, and its layers as ``shared_by`` (0.22+) or ``layers``."""

    size: int


class KVCacheConfigLike(Protocol):
    """vLLM's ``KVCacheConfig`` (every build): the pool size, its tensors and groups."""

    num_blocks: int
    kv_cache_tensors: Sequence[KVCacheTensorLike]
    kv_cache_groups: Sequence[KVCacheGroupLike]
