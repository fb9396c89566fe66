"""The installed build's features as ONE cached, typed object.

``compat.probe.FEATURES`` says how to detect each feature (and what a vendor build must
provide); this object is how the rest of ``compat`` reads them: ``capabilities().mamba_type``
instead of a string lookup that re-runs ``inspect`` on every call. Each attribute is probed on
first read (so importing compat stays free of vLLM imports) and then kept. The labels are
typed, so a branch on a label that no probe can return is a type error, not a dead branch.
``tests/test_capabilities.py`` holds this class and ``FEATURES`` to the same keys.
"""

from __future__ import annotations

import functools
from functools import cached_property
from typing import Literal, cast

from vllm_flagcx.compat.probe import FEATURES_BY_KEY, locate

Absent = Literal["absent"]


def _label(key: str) -> str:
    return FEATURES_BY_KEY[key].probe()


class Capabilities:
    """Feature labels of the installed vLLM, probed lazily, once each."""

    @cached_property
    def connector_kv_cache_config_arg(self) -> Literal["required", "optional", "absent"]:
        return cast("Literal['required', 'optional', 'absent']",
                    _label("connector_kv_cache_config_arg"))

    @cached_property
    def handle_preemptions(self) -> Literal["set", "metadata", "absent"]:
        return cast("Literal['set', 'metadata', 'absent']", _label("handle_preemptions"))

    @cached_property
    def prefer_cross_layer_blocks(self) -> Literal["property", "classvar", "absent"]:
        return cast("Literal['property', 'classvar', 'absent']",
                    _label("prefer_cross_layer_blocks"))

    @cached_property
    def handshake_pp_aware(self) -> Literal["native", "absent"]:
        return cast("Literal['native', 'absent']", _label("handshake_pp_aware"))

    @cached_property
    def new_request_hook(self) -> Literal["native", "absent"]:
        return cast("Literal['native', 'absent']", _label("new_request_hook"))

    @cached_property
    def attn_backend_block_size(self) -> Literal["parameter", "absent"]:
        return cast("Literal['parameter', 'absent']", _label("attn_backend_block_size"))

    @cached_property
    def current_attn_backends(self) -> Literal["list", "single", "layer_walk"]:
        return cast("Literal['list', 'single', 'layer_walk']", _label("current_attn_backends"))

    @cached_property
    def kv_layout(self) -> Literal["get_kv_cache_layout", "resolved_layout", "absent"]:
        return cast("Literal['get_kv_cache_layout', 'resolved_layout', 'absent']",
                    _label("kv_layout"))

    @cached_property
    def kv_cache_tensor_layers(self) -> Literal["shared_by", "layers", "absent"]:
        return cast("Literal['shared_by', 'layers', 'absent']", _label("kv_cache_tensor_layers"))

    @cached_property
    def mamba_type(self) -> Literal["str", "enum", "absent"]:
        return cast("Literal['str', 'enum', 'absent']", _label("mamba_type"))

    @cached_property
    def unhashed_block_ids_all_groups(self) -> Literal["native", "computed"]:
        return cast("Literal['native', 'computed']", _label("unhashed_block_ids_all_groups"))

    @cached_property
    def block_ids_group_ids(self) -> Literal["kwarg", "absent"]:
        return cast("Literal['kwarg', 'absent']", _label("block_ids_group_ids"))

    @cached_property
    def hma_default(self) -> Literal["auto", "off_with_connector"]:
        return cast("Literal['auto', 'off_with_connector']", _label("hma_default"))

    @cached_property
    def conv_state_layouts(self) -> Literal["SD,DS", "SD"]:
        return cast("Literal['SD,DS', 'SD']", _label("conv_state_layouts"))

    @cached_property
    def truncate_block_hashes(self) -> Literal["native", "absent"]:
        return cast("Literal['native', 'absent']", _label("truncate_block_hashes"))

    @cached_property
    def hybrid_async_load(self) -> Literal["single_group", "multi_group", "absent"]:
        return cast("Literal['single_group', 'multi_group', 'absent']",
                    _label("hybrid_async_load"))

    @cached_property
    def hybrid_load_failure_report(self) -> Literal["failed_recving", "worker_meta", "absent"]:
        return cast("Literal['failed_recving', 'worker_meta', 'absent']",
                    _label("hybrid_load_failure_report"))

    @cached_property
    def failed_load_blocks(self) -> Literal["freed", "absent"]:
        return cast("Literal['freed', 'absent']", _label("failed_load_blocks"))

    @cached_property
    def mamba_align_external_tokens(self) -> Literal["asserts_none", "accepted", "absent"]:
        return cast("Literal['asserts_none', 'accepted', 'absent']",
                    _label("mamba_align_external_tokens"))

    @cached_property
    def resumed_requests(self) -> Literal["resumed_req_ids", "scheduled_new_reqs"]:
        return cast("Literal['resumed_req_ids', 'scheduled_new_reqs']",
                    _label("resumed_requests"))

    @cached_property
    def dp_index_field(self) -> Literal["data_parallel_index", "data_parallel_rank"]:
        return cast("Literal['data_parallel_index', 'data_parallel_rank']",
                    _label("dp_index_field"))

    @cached_property
    def finished_load_blocks(self) -> Literal["freed", "absent"]:
        return cast("Literal['freed', 'absent']", _label("finished_load_blocks"))

    @cached_property
    def kv_load_failure_policy_default(self) -> str:
        """The field's default ("recompute" / "fail"), or "absent" where the field is."""
        return _label("kv_load_failure_policy_default")

    @cached_property
    def legacy_kv_fields(self) -> Literal["accepted", "forbidden"]:
        return cast("Literal['accepted', 'forbidden']", _label("legacy_kv_fields"))


@functools.cache
def capabilities() -> Capabilities:
    """The one Capabilities object of this process."""
    return Capabilities()


def clear_caches() -> None:
    """Forget resolved names and probed features (tests that hide a capability call this)."""
    locate.cache_clear()
    capabilities.cache_clear()
