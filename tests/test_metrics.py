"""The exported Prometheus families (``wire.metrics``): how reports merge across workers,
what a worker reports, what reaches a real prometheus registry through the connector's
``build_prom_metrics``, and that the shipped Grafana dashboard and the README name only
families that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vllm_flagcx.connector.common.counters import Observations
from vllm_flagcx.wire import metrics

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "examples" / "grafana" / "vllm-flagcx-pd-dashboard.json"


def test_reports_merge_counters_add_samples_join_gauges_take_the_largest_rank():
    a = {"send_bytes": 10, "pull_seconds": [0.1], "pending_sends": 2}
    b = {"send_bytes": 5, "pull_seconds": [0.2, 0.3], "pending_sends": 3,
         "pending_pulls": 0}
    merged = metrics.merge(dict(a), b)
    assert merged == {"send_bytes": 15, "pull_seconds": [0.1, 0.2, 0.3],
                      "pending_sends": 3, "pending_pulls": 0}
    many = {"bytes_transferred": [1.0] * (metrics.MAX_SAMPLES_PER_REPORT + 5)}
    assert len(metrics.merge({"bytes_transferred": [2.0]}, many)["bytes_transferred"]) == \
        metrics.MAX_SAMPLES_PER_REPORT


def test_a_gauge_back_at_zero_is_news_an_unchanged_counter_is_not():
    assert metrics.is_empty({"send_bytes": 0, "pull_seconds": []})
    assert not metrics.is_empty({"pending_sends": 0})
    assert not metrics.is_empty({"pull_seconds": [0.01]})


def test_a_worker_reports_samples_once_and_a_gauge_until_it_drops_to_zero():
    obs = Observations()
    obs.observe("pull_seconds", 0.004)
    obs.pull_started()
    assert obs.take(pending_sends=2) == {"pull_seconds": [0.004], "pending_sends": 2,
                                         "pending_pulls": 1}
    obs.pull_ended()
    assert obs.take(pending_sends=0) == {"pending_sends": 0, "pending_pulls": 0}
    assert obs.take(pending_sends=0) == {}  # idle: nothing to say
    for _ in range(metrics.MAX_SAMPLES_PER_REPORT + 10):
        obs.observe("bytes_transferred", 1)
    assert len(obs.take(0)["bytes_transferred"]) == metrics.MAX_SAMPLES_PER_REPORT
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
    prom.observe({"send_bytes": 4096, "num_failed_transfers": 2, "pull_seconds": [0.002, 0.3],
                  "bytes_transferred": [1 << 20], "pending_sends": 3, "not_a_family": 7},
                 engine_idx=1)
    prom.observe({"send_bytes": 1024, "pending_sends": 0}, engine_idx=1)
    value = registry.get_sample_value
    assert value("vllm:flagcx_sent_bytes_total", labels) == 5120
    assert value("vllm:flagcx_num_failed_transfers_total", labels) == 2
    assert value("vllm:flagcx_pull_seconds_count", labels) == 2
    assert value("vllm:flagcx_pull_seconds_bucket", {**labels, "le": "0.005"}) == 1
    assert value("vllm:flagcx_bytes_transferred_sum", labels) == 1 << 20
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


def test_the_docs_list_every_family_and_nixls_families_exist_here_with_their_kind():
    """docs/metrics.md names every family with its kind; each NIXL family NIXL_FAMILIES
    lists is, under vllm:flagcx_, in the installed vLLM's NIXL stats (where it has them)
    and here with the same kind."""
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for family in metrics.FAMILIES:
        assert f"| `{family.name}` | {family.kind.value} |" in doc, family.name
    names = {f.name: f for f in metrics.FAMILIES}
    for suffix in metrics.NIXL_FAMILIES:
        family = names[f"vllm:flagcx_{suffix}"]
        assert f"`vllm:nixl_{suffix}`" in doc
        assert family.kind is (metrics.Kind.HISTOGRAM if suffix.endswith(
            ("seconds", "transferred", "descriptors")) else metrics.Kind.COUNTER)
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import stats as nixl_stats
    except ImportError:  # builds before NIXL's stats module: the names as of vLLM 0.34
        return
    source = Path(nixl_stats.__file__).read_text()
    assert set(re.findall(r'name="vllm:nixl_([a-z_]+)"', source)) <= set(metrics.NIXL_FAMILIES)


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




def test_every_panel_of_both_dashboards_shows_data_from_a_real_pd_run():
    """Prefill and decode as real connectors on vLLM's Scheduler (``via_entry``: the stats
    leave through ``get_kv_connector_stats`` as in an engine), each engine's report fed to
    its own registry through the connector's Prometheus class, scraped before and after a
    PD request: every connector panel of the project dashboard and every NIXL PD panel
    pointed at flagcx shows data; the same NIXL panels unchanged show none (control)."""
    import time

    import prometheus_client
    from testkit import dashboards, promql
    from testkit import pd_harness as pd
    from testkit.pd_drive import run_pd

    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense", via_entry=True)
    d = pd.build_instance("kv_consumer", 1, pd.free_port(), model="dense", via_entry=True)
    engines = {"p:8100": (p, *registry_with_connector_metrics()),
               "d:8200": (d, *registry_with_connector_metrics())}

    def scrape() -> promql.Scrape:
        series = {}
        for instance, (inst, registry, prom) in engines.items():
            assert inst.entry is not None
            for connector in inst.entry.connectors:
                stats = connector.get_kv_connector_stats()
                if stats is not None:
                    prom.observe(stats.data, engine_idx=0)
            series.update(promql.parse_exposition(
                prometheus_client.generate_latest(registry).decode(), instance=instance))
        return promql.Scrape(time.monotonic(), series)

    try:
        before = scrape()
        run_pd(p, d, prompts=[48, 40])
        after = scrape()
    finally:
        p.shutdown()
        d.shutdown()
    ours = {t: q for t, q in dashboards.project_panels(".*:8100", ".*:8200").items()
            if "vllm:flagcx_" in q}
    assert len(ours) >= 20
    assert dashboards.without_data(ours, before, after) == []
    nixl = dashboards.NIXL_PD_PANELS
    pointed = {t: dashboards.pointed_at_flagcx(q) for t, q in nixl.items()}
    assert dashboards.without_data(pointed, before, after) == []
    assert sorted(dashboards.without_data(nixl, before, after)) == sorted(nixl)


def test_the_evaluator_reads_rates_sums_and_quantiles_as_prometheus_does():
    from testkit import promql

    text = ('h_bucket{le="0.1",i="a"} %d\nh_bucket{le="1.0",i="a"} %d\n'
            'h_bucket{le="+Inf",i="a"} %d\nc_total{i="a"} %d\nc_total{i="b"} %d\n')
    before = promql.Scrape(0.0, promql.parse_exposition(text % (0, 0, 0, 10, 0)))
    after = promql.Scrape(10.0, promql.parse_exposition(text % (50, 100, 100, 30, 40)))
    run = lambda q: promql.evaluate(q, before, after)  # noqa: E731
    assert run("sum(rate(c_total[5m]))") == {frozenset(): 6.0}
    assert run('sum by (i) (increase(c_total{i=~"a|b"}[1m]))') == {
        frozenset({("i", "a")}): 20.0, frozenset({("i", "b")}): 40.0}
    (median,) = run("histogram_quantile(0.5, sum by (le) (rate(h_bucket[5m])))").values()
    assert median == pytest.approx(0.1)  # rank 50 ends the first bucket
    (p75,) = run("histogram_quantile(0.75, sum by (le) (rate(h_bucket[5m])))").values()
    assert p75 == pytest.approx(0.1 + 0.9 * 0.5)  # halfway into (0.1, 1.0]
    assert run("sum(rate(c_total[5m])) / sum(rate(c_total[5m])) * 1000") == {
        frozenset(): 1000.0}
    assert not promql.has_data(run("sum(rate(missing_total[5m]))"))
    assert not promql.has_data(run("histogram_quantile(0.5, sum by (le) "
                                   "(rate(c_total[5m])))"))  # no buckets: nothing drawn
    with pytest.raises(promql.PromQLError, match="avg_over_time"):
        run("avg_over_time(c_total[5m])")
