"""N-1 rule on real Requests, conv layout, config reads that survive removed fields."""

from __future__ import annotations

import pytest
from testkit import pd_caches, vllm_reads
from testkit import vllm_harness as harness

from vllm_flagcx.compat import config, vllm_writes
from vllm_flagcx.compat import kv_cache as mamba
from vllm_flagcx.connector.scheduler import SchedulerHalf, SchedulerSettings


def test_remote_prefill_token_count():
    assert mamba.remote_prefill_token_count(100, has_mamba=True) == 99
    assert mamba.remote_prefill_token_count(100, has_mamba=False) == 100
    assert mamba.remote_prefill_token_count(1, has_mamba=True) == 1


def test_truncate_for_prefill_cuts_once_and_leaves_the_params_alone():
    """Prefill of a hybrid model cuts a request to N-1 once: a preempted request comes back
    through the same hook and keeps N-1. The user's kv_transfer_params are only read."""
    half = SchedulerHalf(SchedulerSettings("p", "127.0.0.1", 1, 1),
                         pd_caches.rank_kv_cache_config(tp=1, num_blocks=8))
    params = {"do_remote_decode": True}
    request = harness.make_request(33, max_tokens=8, kv_transfer_params=params)
    for _ in range(2):  # scheduled, then preempted and scheduled again
        assert half.get_num_new_matched_tokens(request, 0) == (0, False)
        assert request.num_prompt_tokens == 32 and len(request.prompt_token_ids) == 32
        assert request.num_tokens == 32 and request.max_tokens == 1
    assert len(getattr(request, "block_hashes", [])) <= 32 // 16
    assert params == {"do_remote_decode": True}
    half.shutdown()


def test_truncate_needs_transfer_params():
    request = harness.make_request(10)
    assert vllm_writes.truncate_for_prefill(request) is False
    assert request.num_prompt_tokens == 10


def test_conv_layout_follows_env(monkeypatch, matrix_build):
    assert mamba.conv_state_layout() in {"SD", "DS"}
    if "DS" not in matrix_build.profile["conv_state_layouts"]:
        monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
        assert mamba.conv_state_layout() == "SD"  # 0.13 has SD only


def test_dp_index_and_failure_policy(matrix_build):
    vllm_config = harness.make_vllm_config()
    assert config.dp_index(vllm_config.parallel_config) == 0
    expected = matrix_build.profile["kv_load_failure_policy_default"]
    assert vllm_reads.failure_policy(vllm_config.kv_transfer_config) == expected


def test_removed_fields_read_with_defaults(matrix_build):
    ktc = harness.make_vllm_config(extra_config={"transport": "local"}).kv_transfer_config
    assert config.kv_transfer_field(ktc, "kv_ip", "127.0.0.1") == "127.0.0.1"
    assert config.kv_transfer_field(ktc, "no_such_field", 5) == 5
    has_kv_ip = hasattr(ktc, "kv_ip")
    assert has_kv_ip == (matrix_build.profile["legacy_kv_fields"] == "accepted")


def test_env_survives_removed_vllm_env_names(monkeypatch):
    monkeypatch.setenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "12")
    assert config.env("VLLM_NIXL_ABORT_REQUEST_TIMEOUT") == "12"
    assert config.env("VLLM_FLAGCX_NOT_SET", "x") == "x"


def test_resumed_request_ids_on_a_real_scheduler_output(matrix_build):
    scheduler = harness.make_scheduler(harness.make_vllm_config(),
                                       harness.dense_kv_cache_config())
    request = harness.make_request(20)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert vllm_reads.resumed_request_ids(out, seen_new_before=set()) == set()
    if matrix_build.profile["resumed_requests"] == "scheduled_new_reqs":
        assert vllm_reads.resumed_request_ids(out, {request.request_id}) == {
            request.request_id}


@pytest.mark.parametrize("arg", [{"r1", "r2"}, "metadata"])
def test_handle_preemptions_accepts_both_forms(arg):
    from vllm_flagcx.connector.entry import FlagCXConnectorMetadata

    scheduler = harness.make_scheduler(harness.make_vllm_config(),
                                       harness.dense_kv_cache_config())
    seen = []
    connector = scheduler.connector
    connector.on_preemptions = seen.append
    if arg == "metadata":
        meta = FlagCXConnectorMetadata()
        meta.preempted_req_ids = {"r1", "r2"}
        arg = meta
    connector.handle_preemptions(arg)
    assert seen == [{"r1", "r2"}]


def test_connector_base_keeps_kv_cache_config():
    kv_config = harness.dense_kv_cache_config()
    scheduler = harness.make_scheduler(harness.make_vllm_config(), kv_config)
    assert scheduler.connector.kv_cache_config is kv_config
    done, params = scheduler.connector.request_finished(harness.make_request(3), [1, 2])
    assert (done, params) == (False, None)


def test_sliding_window_groups_keep_only_the_window():
    from vllm_flagcx.connector.scheduler import clip_to_window

    ids = list(range(10, 20))
    assert clip_to_window(ids, None, 16) == ids
    assert clip_to_window(ids, 32, 16) == [17, 18, 19]  # 2 window blocks + the partial one
    assert clip_to_window(ids, 1000, 16) == ids
