"""The entry class vLLM instantiates, once per role (scheduler process, each worker).

It dispatches every hook to the half for its role. The halves are written against
``vllm_flagcx.compat`` only.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_flagcx.compat.blocks import require_hma_for_mamba
from vllm_flagcx.compat.connector_api import (
    KVConnectorMetadata,
    PortableConnectorBase,
    role_is_scheduler,
)

logger = logging.getLogger("vllm_flagcx")


class FlagCXConnectorMetadata(KVConnectorMetadata):
    """Per-step scheduler -> worker metadata: what to receive and what to send."""

    def __init__(self) -> None:
        self.recv: dict[str, Any] = {}
        self.send: dict[str, Any] = {}


class FlagCXConnector(PortableConnectorBase):
    """Prefill/decode KV connector over FlagCX (HMA-aware: one block list per group)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        require_hma_for_mamba(vllm_config, kv_cache_config)
        self.is_scheduler = role_is_scheduler(role)

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return FlagCXConnectorMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        return None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
