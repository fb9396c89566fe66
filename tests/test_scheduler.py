"""The real vLLM Scheduler builds and runs with FlagCXConnector on every build, HMA on."""

from __future__ import annotations

import pytest
from testkit import vllm_harness as harness

from vllm_flagcx.compat import kv_cache as blocks
from vllm_flagcx.compat import plugin
from vllm_flagcx.connector import FlagCXConnector


@pytest.mark.parametrize("model", [harness.DENSE_MODEL, harness.HYBRID_MODEL],
                         ids=["dense", "hybrid"])
def test_scheduler_builds_with_module_path(model):
    kv_config = (harness.hybrid_kv_cache_config() if model == harness.HYBRID_MODEL
                 else harness.dense_kv_cache_config())
    config = harness.make_vllm_config(model=model, hma=True, kv_role="kv_producer")
    scheduler = harness.make_scheduler(config, kv_config)
    assert type(scheduler.connector) is FlagCXConnector
    assert scheduler.connector.is_scheduler
    assert blocks.hma_state(config).enabled


def test_requests_run_to_completion_and_free_every_block():
    config = harness.make_vllm_config(model=harness.HYBRID_MODEL, hma=True,
                                      kv_role="kv_producer")
    scheduler = harness.make_scheduler(config, harness.hybrid_kv_cache_config())
    for n in (5, 17, 40):
        scheduler.add_request(harness.make_request(n, max_tokens=3))
    outputs = harness.run_until_done(scheduler)
    finished = {o.request_id for step in outputs for eng in step.values()
                for o in eng.outputs if o.finish_reason is not None}
    assert len(finished) == 3
    assert not scheduler.has_requests()
    assert harness.blocks_in_use(scheduler) == 0


def test_registered_name_resolves_through_vllm_factory():
    from vllm_flagcx.compat.probe import resolve

    factory = resolve("KVConnectorFactory")
    plugin.register()
    assert plugin.CONNECTOR_NAME in factory._registry
    assert plugin.register() is False  # second call: kept, no ValueError from vLLM
    config = harness.make_vllm_config(module_path=None, hma=True)
    scheduler = harness.make_scheduler(config, harness.dense_kv_cache_config())
    assert type(scheduler.connector) is FlagCXConnector


def test_plugin_keeps_a_foreign_registration(monkeypatch, caplog):
    from vllm_flagcx.compat.probe import resolve

    factory = resolve("KVConnectorFactory")
    monkeypatch.setattr(factory, "_registry", {plugin.CONNECTOR_NAME: lambda: "theirs"})
    with caplog.at_level("INFO", logger="vllm_flagcx"):
        assert plugin.register() is False
    assert factory._registry[plugin.CONNECTOR_NAME]() == "theirs"
    assert "already registered" in caplog.text


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.general_plugins")
           if ep.value == "vllm_flagcx.compat.plugin:register"]
    assert len(eps) == 1


def test_hybrid_decode_role_refused_where_vllm_cannot_finish_it(matrix_build):
    from vllm_flagcx.compat.kv_cache import HybridRemoteLoadUnsupported

    config = harness.make_vllm_config(model=harness.HYBRID_MODEL, hma=True,
                                      kv_role="kv_consumer")
    if matrix_build.profile["hybrid_async_load"] == "single_group":
        with pytest.raises(HybridRemoteLoadUnsupported, match=r"vLLM >= 0\.20"):
            harness.make_scheduler(config, harness.hybrid_kv_cache_config())
    else:
        scheduler = harness.make_scheduler(config, harness.hybrid_kv_cache_config())
        assert type(scheduler.connector) is FlagCXConnector
    producer = harness.make_vllm_config(model=harness.HYBRID_MODEL, hma=True,
                                        kv_role="kv_producer")
    harness.make_scheduler(producer, harness.hybrid_kv_cache_config())  # prefill: fine


def test_each_request_s_params_are_read_once_and_forgotten_at_its_end(monkeypatch):
    """One owner per request on the scheduler half (``RequestParams``): decode parses a
    request's ``kv_transfer_params`` once over all its hooks (matched, allocated,
    finished), and nothing of it stays after ``request_finished``."""
    from testkit import pd_harness as pd

    from vllm_flagcx.connector import scheduler as scheduler_half

    parsed: list[str] = []
    real = scheduler_half.parse_remote_prefill

    def counting(params):
        parsed.append(str(params["transfer_id"]))
        return real(params)

    monkeypatch.setattr(scheduler_half, "parse_remote_prefill", counting)
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense", via_entry=True)
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense", via_entry=True)
    try:
        records = pd.run_pd(p, d, prompts=[40, 70, 33])
        assert sorted(parsed) == sorted(records)  # one parse per transfer
        assert all(r["d_req"] in pd.finished_ids(d) for r in records.values())
        for inst in (p, d):
            assert inst.scheduler.connector.scheduler._requests == {}
    finally:
        p.shutdown()
        d.shutdown()
