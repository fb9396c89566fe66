"""vLLM 0.34's connector hooks, one test per row of docs/vllm-hooks.md.

Each test drives the installed vLLM's own code (its Scheduler, its config, its connector
factory) with FlagCXConnector; a hook that a build does not have is skipped there by name.
"""

from __future__ import annotations

import pytest
from testkit import pd_harness as pd
from testkit.vllm_harness import (
    HYBRID_MODEL,
    hybrid_kv_cache_config,
    make_request,
    make_vllm_config,
)

from vllm_flagcx.compat.connector_api import KVConnectorRole
from vllm_flagcx.connector import FlagCXConnector


def _base_has(hook: str) -> bool:
    from vllm_flagcx.compat.connector_api import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, hook)


def _needs(hook: str) -> None:
    if not _base_has(hook):
        pytest.skip(f"this vLLM's connector base has no {hook} (0.34+)")


def _factory_class(vllm_config):
    from vllm_flagcx.compat.probe import resolve

    return resolve("KVConnectorFactory").get_connector_class(vllm_config.kv_transfer_config)


def test_kv_cache_access_keeps_the_cache_registrable_and_ipc_shareable():
    """0.34 allocates a driver-mapped ("extensible") KV cache unless a connector says it
    shares it through legacy CUDA IPC; cuIpcGetMemHandle cannot export that memory, and
    RDMA registration needs one physical allocation per segment."""
    _needs("kv_cache_access")
    config = make_vllm_config()
    access = config.kv_transfer_config.kv_cache_access()  # vLLM's own resolution
    flags = type(access)
    assert access == flags.REGISTERS | flags.LEGACY_IPC
    assert access.needs_single_chunk()


def test_sleep_mode_is_refused_by_name_on_every_build():
    config = make_vllm_config()
    if _base_has("supports_sleep_mode"):  # what 0.34's VllmConfig asks before it starts
        assert _factory_class(config).supports_sleep_mode(config.kv_transfer_config) is False
    config.model_config.enable_sleep_mode = True  # CPU platforms refuse it in ModelConfig
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        FlagCXConnector(config, KVConnectorRole.WORKER)


def test_loaded_groups_are_every_transfer_group_and_none_of_their_blocks_is_zeroed():
    """A hybrid PD load on vLLM's Scheduler: the groups it names are not zeroed by vLLM
    when allocated; the control (a connector naming no group) shows the zeroing happens."""
    _needs("get_loaded_kv_cache_group_ids")
    groups, zeroed, destinations = _run_hybrid_pd()
    assert groups == tuple(range(groups[-1] + 1)) and len(groups) >= 2
    assert destinations and not destinations & zeroed


def test_loaded_groups_control_a_connector_naming_none_gets_its_blocks_zeroed(monkeypatch):
    _needs("get_loaded_kv_cache_group_ids")
    monkeypatch.setattr(FlagCXConnector, "get_loaded_kv_cache_group_ids", lambda self, r: ())
    _, zeroed, destinations = _run_hybrid_pd()
    assert destinations & zeroed


def _run_hybrid_pd() -> tuple[tuple[int, ...], set[int], set[int]]:
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, seed=1)
    d = pd.build_instance("kv_consumer", 1, port + 5, seed=2)
    try:
        records = pd.run_pd(p, d, prompts=[37, 70])
        assert records and all(r["params"] for r in records.values())
        destinations = {b for task in d.recv_tasks.values() for group in task.block_ids
                        for b in group if b}
        connector = d.scheduler.connector
        request = next(iter(d.scheduler.requests.values()), None)
        groups = connector.get_loaded_kv_cache_group_ids(request)
        return groups, set(d.zeroed), destinations
    finally:
        p.shutdown()
        d.shutdown()


def test_may_load_async_agrees_with_the_load_the_connector_starts():
    """vLLM's default (``do_remote_prefill`` in the params) is kept: it names exactly the
    requests whose ``get_num_new_matched_tokens`` answers load_kv_async=True."""
    _needs("may_load_async")
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, seed=1)
    d = pd.build_instance("kv_consumer", 1, port + 5, seed=2)
    try:
        records = pd.run_pd(p, d, prompts=[37])
        params = next(iter(records.values()))["params"]
        connector = d.scheduler.connector
        remote = make_request(37, kv_transfer_params=dict(params))
        plain = make_request(37)
        for request in (remote, plain):
            connector.on_new_request(request)
            _, is_async = connector.get_num_new_matched_tokens(request, 0)
            assert connector.may_load_async(request) is bool(is_async)
        assert connector.may_load_async(remote) and not connector.may_load_async(plain)
    finally:
        p.shutdown()
        d.shutdown()


def test_requires_kv_delivery_on_prefill_only_and_no_pending_block_frees():
    """Prefill hands KV off (a request preempted while its send is pending is recomputed,
    vLLM's default by role); ``has_pending_block_frees`` stays False: prefill's held
    blocks wait on decode, up to the lease, so preempting is the faster way out."""
    _needs("requires_kv_delivery")
    producer, consumer = (
        FlagCXConnector(make_vllm_config(model=HYBRID_MODEL, hma=True, kv_role=role),
                        KVConnectorRole.SCHEDULER, hybrid_kv_cache_config())
        for role in ("kv_producer", "kv_consumer"))
    assert producer.requires_kv_delivery is True
    assert consumer.requires_kv_delivery is False
    if _base_has("has_pending_block_frees"):  # 0.34 (0.28 has requires_kv_delivery only)
        assert producer.has_pending_block_frees() is False


def test_get_transfer_results_reports_a_failed_hybrid_receive_per_request(monkeypatch):
    """0.34 asks the worker role for sends, receives and failed receives together; a
    hybrid failure must come back per request (block ids cannot be mapped to groups) so
    vLLM's own failure path ends it (policy ``fail``, 0.34's default) instead of
    computing over the blocks the load never filled."""
    _needs("get_transfer_results")
    from testkit.transport_standin import Faults
    from testkit.vllm_reads import failure_policy

    reported: set[str] = set()
    original = FlagCXConnector.get_transfer_results

    def recording(self, finished_req_ids):
        results = original(self, finished_req_ids)
        reported.update(results.failed_recving)
        return results

    monkeypatch.setattr(FlagCXConnector, "get_transfer_results", recording)
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, via_entry=True,
                          faults=Faults(fail_write_from=0))
    d = pd.build_instance("kv_consumer", 1, port + 5, via_entry=True, recv_timeout=3.0)
    try:
        records = pd.run_pd(p, d, prompts=[37, 19])
        assert failure_policy(d.scheduler.vllm_config.kv_transfer_config) == "fail"
        assert reported == {r["d_req"] for r in records.values()}
        finished = pd.finished_ids(d)
        assert all(finished[r["d_req"]] == "error" for r in records.values())
        pd.assert_idle(d)
    finally:
        p.shutdown()
        d.shutdown()


def test_the_removed_cross_layer_hooks_are_not_needed():
    """0.34 removed ``prefer_cross_layer_blocks`` / ``register_cross_layers_kv_cache``:
    the connector registers per layer on every build (``register_kv_caches``) and states
    False for the old class attribute, which 0.34 no longer reads."""
    from vllm_flagcx.compat.connector_api import PortableConnectorBase

    assert FlagCXConnector.prefer_cross_layer_blocks is False
    for cls in (FlagCXConnector, PortableConnectorBase):  # never defined by the connector
        assert "register_cross_layers_kv_cache" not in vars(cls), cls.__name__
