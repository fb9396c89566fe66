"""The dashboards a PD operator points at the connector, as queries a test evaluates
(``testkit.promql``): the project's Grafana dashboard, and the panels PD dashboards built
for vLLM's NixlConnector put on its families (``vllm:nixl_*``, vLLM 0.34 ``nixl/stats.py``:
transfer and post time quantiles, bytes and descriptors, throughput, rates of failures and
expiries), which must show data here after ``vllm:nixl_`` -> ``vllm:flagcx_``.
"""

from __future__ import annotations

import json
from pathlib import Path

from testkit import promql

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ROOT / "examples" / "grafana" / "vllm-flagcx-pd-dashboard.json"

_W = "[5m]"


def _quantile(q: float, family: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate(vllm:nixl_{family}_bucket{_W})))"


NIXL_PD_PANELS: dict[str, str] = {
    **{f"transfer time p{int(q * 100)}": _quantile(q, "xfer_time_seconds")
       for q in (0.5, 0.9, 0.99)},
    **{f"post time p{int(q * 100)}": _quantile(q, "post_time_seconds") for q in (0.5, 0.99)},
    **{f"descriptors p{int(q * 100)}": _quantile(q, "num_descriptors") for q in (0.5, 0.99)},
    "bytes p50": _quantile(0.5, "bytes_transferred"),
    "transfers per second": f"sum(rate(vllm:nixl_xfer_time_seconds_count{_W}))",
    "bytes per second": f"sum(rate(vllm:nixl_bytes_transferred_sum{_W}))",
    "MB per transfer": f"sum(rate(vllm:nixl_bytes_transferred_sum{_W})) / "
                       f"sum(rate(vllm:nixl_bytes_transferred_count{_W})) / 1048576",
    "throughput while moving": f"sum(rate(vllm:nixl_bytes_transferred_sum{_W})) / "
                               f"sum(rate(vllm:nixl_xfer_time_seconds_sum{_W}))",
    "average transfer time": f"sum(rate(vllm:nixl_xfer_time_seconds_sum{_W})) / "
                             f"sum(rate(vllm:nixl_xfer_time_seconds_count{_W}))",
    "failed transfers": f"sum(rate(vllm:nixl_num_failed_transfers_total{_W}))",
    "failed notifications": f"sum(rate(vllm:nixl_num_failed_notifications_total{_W}))",
    "expired requests": f"sum(increase(vllm:nixl_num_kv_expired_reqs_total{_W}))",
    "notifications after expiry": "sum(increase("
                                  f"vllm:nixl_num_notifications_after_expiry_total{_W}))",
}


def pointed_at_flagcx(query: str) -> str:
    return query.replace("vllm:nixl_", "vllm:flagcx_")


def project_panels(prefill: str, decode: str) -> dict[str, str]:
    """{panel title / legend: query} of the project dashboard, its variables set as a user
    sets them (``prefill`` and ``decode``: regexes of their scrape instances)."""
    board = json.loads(PROJECT.read_text())
    values = {"$__rate_interval": "1m", "$model_name": ".*", "$prefill": prefill,
              "$decode": decode}
    out = {}
    for panel in board["panels"]:
        for target in panel["targets"]:
            query = target["expr"]
            for name, value in values.items():
                query = query.replace(name, value)
            out[f"{panel['title']} / {target['legendFormat']}"] = query
    return out


def without_data(panels: dict[str, str], before: promql.Scrape, after: promql.Scrape
                 ) -> list[str]:
    """The panels that would draw nothing between the two scrapes."""
    return [title for title, query in panels.items()
            if not promql.has_data(promql.evaluate(query, before, after))]
