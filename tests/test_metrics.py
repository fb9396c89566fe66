"""The exported Prometheus families (``wire.metrics``): how reports merge across workers,
what a worker reports, what reaches a real prometheus registry through the connector's
``build_prom_metrics``, and that the shipped Grafana dashboard and the README name only
families that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vllm_flagcx.connector.common.observations import Observations
from vllm_flagcx.wire import metrics

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "examples" / "grafana" / "vllm-flagcx-pd-dashboard.json"


def test_reports_merge_counters_add_samples_join_gauges_take_the_largest_rank():
    a = {"send_bytes": 10, "transfer_seconds": [0.1], "pending_sends": 2}
    b = {"send_bytes": 5, "transfer_seconds": [0.2, 0.3], "pending_sends": 3,
         "pending_pulls": 0}
    merged = metrics.merge(dict(a), b)
    assert merged == {"send_bytes": 15, "transfer_seconds": [0.1, 0.2, 0.3],
                      "pending_sends": 3, "pending_pulls": 0}
    many = {"transfer_bytes": [1.0] * (metrics.MAX_SAMPLES_PER_REPORT + 5)}
    assert len(metrics.merge({"transfer_bytes": [2.0]}, many)["transfer_bytes"]) == \
        metrics.MAX_SAMPLES_PER_REPORT


def test_a_gauge_back_at_zero_is_news_an_unchanged_counter_is_not():
    assert metrics.is_empty({"send_bytes": 0, "transfer_seconds": []})
    assert not metrics.is_empty({"pending_sends": 0})
    assert not metrics.is_empty({"transfer_seconds": [0.01]})


def test_a_worker_reports_samples_once_and_a_gauge_until_it_drops_to_zero():
    obs = Observations()
    obs.observe("transfer_seconds", 0.004)
    obs.pull_started()
    assert obs.take(pending_sends=2) == {"transfer_seconds": [0.004], "pending_sends": 2,
                                         "pending_pulls": 1}
    obs.pull_ended()
    assert obs.take(pending_sends=0) == {"pending_sends": 0, "pending_pulls": 0}
    assert obs.take(pending_sends=0) == {}  # idle: nothing to say
    for _ in range(metrics.MAX_SAMPLES_PER_REPORT + 10):
        obs.observe("transfer_bytes", 1)
    assert len(obs.take(0)["transfer_bytes"]) == metrics.MAX_SAMPLES_PER_REPORT
    with pytest.raises(KeyError, match="not a histogram"):
        obs.observe("send_bytes", 1)


def registry_with_connector_metrics():
    import prometheus_client
    from testkit import vllm_harness as harness

    from vllm_flagcx.compat.connector_api import FlagCXPromMetrics
    from vllm_flagcx.connector.entry import FlagCXConnector

    registry = prometheus_client.CollectorRegistry()

    def bound(cls):
        def make(**kw):
            return cls(registry=registry, **kw)
        return make

    types = {c: bound(c) for c in (prometheus_client.Counter, prometheus_client.Gauge,
                                   prometheus_client.Histogram)}
    prom = FlagCXConnector.build_prom_metrics(harness.make_vllm_config(), types,
                                              ["model_name", "engine"],
                                              {0: ["m", "0"], 1: ["m", "1"]})
    assert isinstance(prom, FlagCXPromMetrics)
    return registry, prom


def test_every_family_reaches_prometheus_with_its_kind():
    registry, prom = registry_with_connector_metrics()
    labels = {"model_name": "m", "engine": "1"}
    prom.observe({"send_bytes": 4096, "failures_recv": 2, "transfer_seconds": [0.002, 0.3],
                  "transfer_bytes": [1 << 20], "pending_sends": 3, "not_a_family": 7},
                 engine_idx=1)
    prom.observe({"send_bytes": 1024, "pending_sends": 0}, engine_idx=1)
    value = registry.get_sample_value
    assert value("vllm:flagcx_sent_bytes_total", labels) == 5120
    assert value("vllm:flagcx_failures_recv_total", labels) == 2
    assert value("vllm:flagcx_transfer_seconds_count", labels) == 2
    assert value("vllm:flagcx_transfer_seconds_bucket", {**labels, "le": "0.005"}) == 1
    assert value("vllm:flagcx_transfer_bytes_sum", labels) == 1 << 20
    assert value("vllm:flagcx_pending_sends", labels) == 0  # set, not added
    assert value("vllm:flagcx_sent_bytes_total", {"model_name": "m", "engine": "0"}) == 0
    exported = {s.name for fam in registry.collect() for s in fam.samples}
    for family in metrics.FAMILIES:
        assert set(family.samples) <= exported, family.name


def dashboard_metric_names() -> set[str]:
    return set(re.findall(r"vllm:[a-z_:]+", DASHBOARD.read_text()))


def test_every_dashboard_query_names_a_metric_that_exists():
    """Ours: exported by the connector (a real registry); vLLM's own: named in the installed
    vLLM's metrics code. A renamed family makes a panel empty: this fails first."""
    import vllm.v1.metrics.loggers as vllm_loggers

    registry, _ = registry_with_connector_metrics()
    exported = {s.name for fam in registry.collect() for s in fam.samples}
    vllm_source = Path(vllm_loggers.__file__).read_text()
    names = dashboard_metric_names()
    assert any(n.startswith("vllm:flagcx_") for n in names)
    for name in names:
        if name.startswith("vllm:flagcx_"):
            assert name in exported, f"dashboard names {name}, not exported"
        else:
            base = re.sub(r"_(bucket|sum|count|total)$", "", name)
            assert f'"{base}"' in vllm_source, f"dashboard names {name}, not in vLLM"
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in panels)


def test_the_readme_documents_every_family_and_its_nixl_twin():
    readme = (ROOT / "README.md").read_text()
    for family in metrics.FAMILIES:
        assert f"`{family.name}`" in readme, family.name
    for nixl, ours in metrics.NIXL_EQUIVALENT.items():
        assert f"`{nixl}`" in readme and ours in {f.name for f in metrics.FAMILIES}


def test_every_counted_stat_is_an_exported_family_and_gauges_report_levels():
    """A worker can count only what Prometheus shows (``Stat`` names a family), and a
    level set twice reports the level, not the difference."""
    from vllm_flagcx.connector.common.counters import Counters

    families = {f.key: f for f in metrics.FAMILIES}
    assert {s.value for s in metrics.Stat} <= set(families)
    counters = Counters()
    counters.set(metrics.Stat.REGISTERED_STORAGES, 5)
    counters.add(metrics.Stat.REFUSED_PEERS)
    assert counters.take_delta() == {"registered_storages": 5, "refused_peers": 1}
    counters.set(metrics.Stat.REGISTERED_STORAGES, 7)
    counters.add(metrics.Stat.REFUSED_PEERS, 2)
    assert counters.take_delta() == {"registered_storages": 7, "refused_peers": 2}
    assert counters.take_delta() == {}
