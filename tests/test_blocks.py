"""Block-id helpers on real KVCacheBlocks from a real KVCacheManager; HMA rules."""

from __future__ import annotations

import pytest
from testkit import vllm_harness as harness

from vllm_flagcx.compat import kv_cache as blocks
from vllm_flagcx.compat.kv_cache import HybridManagerRequired


@pytest.fixture(scope="module")
def hybrid_scheduler():
    # kv_producer: a hybrid decode role is refused on builds that cannot finish its loads.
    config = harness.make_vllm_config(model=harness.HYBRID_MODEL, hma=True,
                                      kv_role="kv_producer")
    return harness.make_scheduler(config, harness.hybrid_kv_cache_config())


def _allocate(scheduler, num_tokens):
    request = harness.make_request(num_tokens)
    scheduler.add_request(request)
    scheduler.schedule()
    return request, scheduler.kv_cache_manager.get_blocks(request.request_id)


def test_block_ids_per_group(hybrid_scheduler):
    request, kv_blocks = _allocate(hybrid_scheduler, 40)
    ids = blocks.block_ids(kv_blocks)
    assert len(ids) == 4  # 1 full-attention group + 3 GDN groups
    assert len(ids[0]) == 3  # ceil(40 / 16) attention blocks
    assert all(len(g) >= 1 for g in ids[1:])
    flat = [b for g in ids for b in g]
    assert len(flat) == len(set(flat)) and blocks.null_block_id() not in flat
    assert blocks.block_ids(kv_blocks, group_ids=[0, 2]) == (ids[0], ids[2])
    hybrid_scheduler.finish_requests(request.request_id, _finished_status())


def test_unhashed_ids_native_and_computed_agree(hybrid_scheduler, matrix_build):
    request, kv_blocks = _allocate(hybrid_scheduler, 33)
    # Prefix caching is off: every allocated block is unhashed.
    expected = [list(g) for g in blocks.block_ids(kv_blocks)]
    assert blocks.unhashed_block_ids_all_groups(kv_blocks) == expected
    computed = [[b.block_id for b in g if b.block_hash is None and not getattr(b, "is_null",
                                                                                  False)]
                for g in kv_blocks.blocks]
    assert computed == expected
    native = getattr(kv_blocks, "get_unhashed_block_ids_all_groups", None)
    assert (native is not None) == (
        matrix_build.profile["unhashed_block_ids_all_groups"] == "native")
    hybrid_scheduler.finish_requests(request.request_id, _finished_status())


def test_null_block_stripped(matrix_build):
    null = blocks.null_block_id()
    assert null == 0
    assert blocks.strip_null_blocks([null, 5, null, 7]) == [5, 7]


def test_hma_state_resolves_like_vllm(matrix_build):
    """Our HMA label matches what the real VllmConfig resolved for our connector."""
    config = harness.make_vllm_config(model=harness.HYBRID_MODEL, hma=None)
    resolved_off = config.scheduler_config.disable_hybrid_kv_cache_manager
    state = blocks.hma_state(config)
    if matrix_build.profile["hma_default"] == "auto":
        assert resolved_off is False and state.enabled
    else:
        assert resolved_off is True and not state.enabled
    explicit = harness.make_vllm_config(model=harness.HYBRID_MODEL, hma=True)
    assert blocks.hma_state(explicit).enabled


def test_refuse_not_degrade_for_mamba_without_hma():
    config = harness.make_vllm_config(model=harness.DENSE_MODEL, hma=False)
    with pytest.raises(HybridManagerRequired, match="--no-disable-hybrid-kv-cache-manager"):
        blocks.require_hma_for_mamba(config, harness.hybrid_kv_cache_config())
    blocks.require_hma_for_mamba(config, harness.dense_kv_cache_config())  # no Mamba: fine


def _finished_status():
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED
