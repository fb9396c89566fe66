"""Entry-class pieces that need no running engine: factory loading, worker metadata."""

from __future__ import annotations

import sys

import pytest
from testkit import vllm_harness as harness

from vllm_flagcx.connector.common.settings import ConnectorSettings, SettingsError
from vllm_flagcx.connector.common.transport_choice import (
    chosen_transport,
    load_factory,
    make_transport,
)
from vllm_flagcx.connector.entry import FlagCXConnector, FlagCXWorkerMetadata


def test_transport_factory_errors_name_the_key():
    with pytest.raises(ValueError, match="transport_factory='nocolon' must be 'module:callable'"):
        load_factory("nocolon")
    with pytest.raises(ValueError, match=r"transport_factory='no\.such\.module:make' cannot be"):
        load_factory("no.such.module:make")
    assert load_factory("testkit.transport_standin:MemmoveTransport").__name__ == "MemmoveTransport"


def test_worker_metadata_aggregates_failures_across_ranks():
    merged = FlagCXWorkerMetadata({"a"}).aggregate(FlagCXWorkerMetadata({"b"}))
    assert merged.failed_recving == {"a", "b"}


def test_required_layout_is_hnd_unless_mla():
    config = harness.make_vllm_config()
    assert FlagCXConnector.get_required_kvcache_layout(config) == "HND"


def test_scheduler_side_rejects_malformed_params_by_computing_locally():
    scheduler = harness.make_scheduler(harness.make_vllm_config(kv_role="kv_consumer"),
                                       harness.dense_kv_cache_config())
    request = harness.make_request(20, kv_transfer_params={"do_remote_prefill": True,
                                                           "remote_port": "x"})
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {request.request_id: 20}  # computed here, not lost
    assert scheduler.connector.scheduler.rejected_params == 1


def test_transport_selection_by_name(monkeypatch):
    monkeypatch.delenv("FLAGCX_LIB_PATH", raising=False)
    monkeypatch.delenv("FLAGCX_PATH", raising=False)
    assert chosen_transport(ConnectorSettings.from_extra({})) == "local"  # no binding here
    assert chosen_transport(ConnectorSettings.from_extra({"transport": "flagcx"})) == "flagcx"
    with pytest.raises(SettingsError, match="transport='rdma': use one of auto, flagcx"):
        ConnectorSettings.from_extra({"transport": "rdma"})


def test_make_transport_calls_the_named_factory_with_config_and_rank(monkeypatch):
    """``transport_factory`` wins over ``transport`` and gets ``(vllm_config, tp_rank)``;
    the built-in local transport needs no library."""
    import types

    from vllm_flagcx.transport.local import LocalTransport

    calls = []

    def make(config, rank):
        calls.append((config, rank))
        return LocalTransport()

    module = types.ModuleType("my_transports")
    module.make = make
    monkeypatch.setitem(sys.modules, "my_transports", module)
    named = ConnectorSettings.from_extra({"transport": "flagcx",
                                          "transport_factory": "my_transports:make"})
    made = make_transport(named, "cfg", 3, host_memory=True)
    assert isinstance(made, LocalTransport) and calls == [("cfg", 3)]
    made.close()
    local = make_transport(ConnectorSettings.from_extra({"transport": "local"}), "cfg", 0,
                           host_memory=True)
    assert isinstance(local, LocalTransport)
    local.close()


def test_cpu_binding_warning_names_the_setting_only_when_auto_pinned():
    from vllm_flagcx.connector.common.host_cpus import cpu_binding_warning

    hint = cpu_binding_warning({0}, {0, 1}, None, host_memory=True)
    assert hint and "VLLM_CPU_OMP_THREADS_BIND" in hint and "[0]" in hint
    assert cpu_binding_warning({0}, {0, 1}, "auto", host_memory=True) == hint
    assert cpu_binding_warning({0}, {0, 1}, "0", host_memory=True) is None  # operator chose
    assert cpu_binding_warning({0, 1}, {0, 1}, None, host_memory=True) is None  # not pinned
    assert cpu_binding_warning({0}, {0, 1}, None, host_memory=False) is None  # GPU caches
