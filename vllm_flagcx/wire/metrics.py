"""The Prometheus families FlagCXConnector exports: one catalog, the contract a PD dashboard
reads over HTTP (``/metrics`` of each vLLM server).

Semantics follow vLLM's NixlConnector (``vllm:nixl_*``) so a dashboard built for NIXL
maps one to one (``NIXL_EQUIVALENT``): transfer time, bytes and descriptors are histograms
observed **once per request on decode** (the side that waits), from the first pull message
to the last prefill rank's reply, integrity check included; failures and expired leases
are counters; what is held or in flight now is a gauge.

How a value travels: each worker reports, per engine step, the counters that grew, the
samples it observed (bounded per step) and its gauges; vLLM aggregates the workers of an
engine (``aggregate``: counters add, samples concatenate, gauges take the largest rank's
value, since every rank holds the same requests) and hands the result to the Prometheus
class in ``compat.connector_api``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(enum.Enum):
    COUNTER = "counter"
    HISTOGRAM = "histogram"
    GAUGE = "gauge"


# NIXL's buckets (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py), so the
# same quantile queries mean the same thing.
SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0,
                   5.0)
BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))  # 2 KiB .. 8 GiB
DESCRIPTOR_BUCKETS = (10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 200.0, 400.0, 1000.0, 2000.0,
                      4000.0, 10000.0, 20000.0, 50000.0)

MAX_SAMPLES_PER_REPORT = 4096  # a histogram key's samples kept per step and worker


class Stat(str, enum.Enum):
    """What a worker counts (``connector.counters.Counters``): each member is the key of
    one exported family below, so a count that Prometheus would not show cannot be
    named (``tests/test_metrics.py`` holds both directions)."""

    SEND_BYTES = "send_bytes"
    SEND_DESCRIPTORS = "send_descriptors"
    SEND_SECONDS = "send_seconds"
    SEND_FAILURES = "send_failures"
    RECV_REQUESTS = "recv_requests"
    RECV_BYTES = "recv_bytes"
    RECV_SECONDS = "recv_seconds"
    EXPIRED_LEASES = "expired_leases"
    LEASE_RENEWALS = "lease_renewals"
    RELEASE_RETRIES = "release_retries"
    INTEGRITY_FAILURES = "integrity_failures"
    INTEGRITY_DIGEST_LAYERS = "integrity_digest_layers"
    INTEGRITY_SKIPPED_DEVICE = "integrity_skipped_device"
    IDLE_STEP_WAITS = "idle_step_waits"
    HANDSHAKES_SERVED = "handshakes_served"
    REFUSED_PEERS = "refused_peers"
    REFUSED_ROLES = "refused_roles"
    UNAUTHENTICATED_MESSAGES = "unauthenticated_messages"
    MALFORMED_MESSAGES = "malformed_messages"
    PULLS_REFUSED_PARKING_FULL = "pulls_refused_parking_full"
    REGISTERED_STORAGES = "registered_storages"


@dataclass(frozen=True)
class Family:
    """One exported family: the key in the stats dict, its Prometheus name and kind."""

    key: str
    name: str
    kind: Kind
    help: str
    side: str  # "prefill", "decode" or "both": where it moves
    buckets: tuple[float, ...] = ()

    @property
    def samples(self) -> tuple[str, ...]:
        """The sample names Prometheus shows for this family."""
        if self.kind is Kind.COUNTER:
            return (self.name + "_total",)
        if self.kind is Kind.HISTOGRAM:
            return tuple(self.name + s for s in ("_bucket", "_sum", "_count"))
        return (self.name,)


FAMILIES: tuple[Family, ...] = (
    Family("transfer_seconds", "vllm:flagcx_transfer_seconds", Kind.HISTOGRAM,
           "Seconds from decode's first pull message to the KV landed and checked, per "
           "request", "decode", SECONDS_BUCKETS),
    Family("transfer_bytes", "vllm:flagcx_transfer_bytes", Kind.HISTOGRAM,
           "Bytes of KV moved per request", "decode", BYTES_BUCKETS),
    Family("transfer_descriptors", "vllm:flagcx_transfer_descriptors", Kind.HISTOGRAM,
           "Descriptors (contiguous runs) written per request", "decode",
           DESCRIPTOR_BUCKETS),
    Family("handshake_seconds", "vllm:flagcx_handshake_seconds", Kind.HISTOGRAM,
           "Seconds of a handshake with a prefill instance (first contact, or its facts "
           "expired)", "decode", SECONDS_BUCKETS),
    Family("pending_sends", "vllm:flagcx_pending_sends", Kind.GAUGE,
           "Requests whose KV prefill holds for decode now (armed, not yet pulled, "
           "released or expired)", "prefill"),
    Family("pending_pulls", "vllm:flagcx_pending_pulls", Kind.GAUGE,
           "Pulls decode has under way now", "decode"),
    Family("send_bytes", "vllm:flagcx_sent_bytes", Kind.COUNTER,
           "Bytes FlagCXConnector wrote to decode", "prefill"),
    Family("send_descriptors", "vllm:flagcx_sent_descriptors", Kind.COUNTER,
           "Descriptors in FlagCX writes", "prefill"),
    Family("send_seconds", "vllm:flagcx_send_seconds", Kind.COUNTER,
           "Seconds spent in FlagCX writes", "prefill"),
    Family("recv_requests", "vllm:flagcx_received_requests", Kind.COUNTER,
           "Requests whose KV arrived", "decode"),
    Family("recv_bytes", "vllm:flagcx_received_bytes", Kind.COUNTER,
           "Bytes of KV that arrived at decode", "decode"),
    Family("recv_seconds", "vllm:flagcx_receive_seconds", Kind.COUNTER,
           "Seconds decode waited for KV to land", "decode"),
    Family("expired_leases", "vllm:flagcx_expired_leases", Kind.COUNTER,
           "Prefill leases that expired unpulled (the blocks were freed)", "prefill"),
    Family("failures_handshake", "vllm:flagcx_failures_handshake", Kind.COUNTER,
           "Requests failed in the handshake stage", "decode"),
    Family("failures_recv", "vllm:flagcx_failures_recv", Kind.COUNTER,
           "Requests whose KV did not arrive whole (vLLM recomputes or fails them)",
           "decode"),
    Family("release_retries", "vllm:flagcx_release_retries", Kind.COUNTER,
           "Release messages to prefill that had to be sent again", "decode"),
    Family("integrity_failures", "vllm:flagcx_integrity_failures", Kind.COUNTER,
           "Pulls whose bytes failed the integrity check", "decode"),
    Family("idle_step_waits", "vllm:flagcx_idle_step_waits", Kind.COUNTER,
           "Engine steps with no token to compute that waited for transfers in flight",
           "both"),
    Family("send_failures", "vllm:flagcx_send_failures", Kind.COUNTER,
           "Pulls prefill could not write (the transport failed, or the write started too "
           "late)", "prefill"),
    Family("lease_renewals", "vllm:flagcx_lease_renewals", Kind.COUNTER,
           "Held transfers whose lease decode's heartbeat renewed", "prefill"),
    Family("integrity_digest_layers", "vllm:flagcx_integrity_digest_layers", Kind.COUNTER,
           "Layer digests decode compared with prefill's (the full logical digest)",
           "decode"),
    Family("integrity_skipped_device", "vllm:flagcx_integrity_skipped_device", Kind.GAUGE,
           "1 where the byte sample is skipped (device memory the CUDA driver cannot read)",
           "decode"),
    Family("handshakes_served", "vllm:flagcx_handshakes_served", Kind.COUNTER,
           "Fact sheets prefill sent to decode workers", "prefill"),
    Family("refused_peers", "vllm:flagcx_refused_peers", Kind.COUNTER,
           "Side-channel messages refused by who sent them (another user without the "
           "secret, or a same-host pull over TCP or naming a process other than the one "
           "that connected, as it ran then)",
           "prefill"),
    Family("refused_roles", "vllm:flagcx_refused_roles", Kind.COUNTER,
           "Side-channel messages a router credential may not send", "prefill"),
    Family("unauthenticated_messages", "vllm:flagcx_unauthenticated_messages", Kind.COUNTER,
           "Side-channel messages without a valid MAC (a secret is set)", "prefill"),
    Family("malformed_messages", "vllm:flagcx_malformed_messages", Kind.COUNTER,
           "Side-channel messages that did not decode or broke their handler", "prefill"),
    Family("pulls_refused_parking_full", "vllm:flagcx_pulls_refused_parking_full",
           Kind.COUNTER, "Early pulls refused because the parking lot was full", "prefill"),
    Family("registered_storages", "vllm:flagcx_registered_storages", Kind.GAUGE,
           "KV cache storages the transport registered (one per contiguous allocation)",
           "both"),
)

BY_KEY = {f.key: f for f in FAMILIES}
GAUGE_KEYS = frozenset(f.key for f in FAMILIES if f.kind is Kind.GAUGE)
HISTOGRAM_KEYS = frozenset(f.key for f in FAMILIES if f.kind is Kind.HISTOGRAM)

# The NIXL family a dashboard built for vLLM's NixlConnector reads -> ours.
NIXL_EQUIVALENT = {
    "vllm:nixl_xfer_time_seconds": "vllm:flagcx_transfer_seconds",
    "vllm:nixl_bytes_transferred": "vllm:flagcx_transfer_bytes",
    "vllm:nixl_num_descriptors": "vllm:flagcx_transfer_descriptors",
    "vllm:nixl_num_failed_transfers": "vllm:flagcx_failures_recv",
    "vllm:nixl_num_failed_notifications": "vllm:flagcx_release_retries",
    "vllm:nixl_num_kv_expired_reqs": "vllm:flagcx_expired_leases",
}


def merge(into: dict[str, object], other: dict[str, object]) -> dict[str, object]:
    """Add ``other``'s report into ``into``: counters add, samples concatenate (bounded),
    gauges keep the larger value. Returns ``into``."""
    for key, value in other.items():
        if key in HISTOGRAM_KEYS:
            mine = into.setdefault(key, [])
            assert isinstance(mine, list) and isinstance(value, list)
            mine.extend(value[:max(0, MAX_SAMPLES_PER_REPORT - len(mine))])
        elif key in GAUGE_KEYS:
            old = into.get(key)
            into[key] = value if old is None else max(old, value)  # type: ignore[call-overload]
        else:
            into[key] = into.get(key, 0) + value  # type: ignore[operator]
    return into


def is_empty(report: dict[str, object]) -> bool:
    """Nothing to tell Prometheus: no counter grew, no sample, no gauge reported (a gauge
    that dropped to 0 is news)."""
    return not any(key in GAUGE_KEYS or value for key, value in report.items())
