"""The Prometheus families FlagCXConnector exports: one catalog, the contract a PD dashboard
reads over HTTP (``/metrics`` of each vLLM server).

Where a family means what one of vLLM's NixlConnector families means, it has NIXL's name
with ``flagcx`` for ``nixl`` (``NIXL_FAMILIES``), NIXL's kind and buckets, so a dashboard
built for NIXL works after that one substitution: ``xfer_time_seconds`` is the data
movement only (one prefill rank's write of one pull, timed on prefill), ``post_time_seconds``
the rest of that transfer (the pull's round trip and prefill's queue), bytes and
descriptors per transfer, all observed on decode (the side that waits, as NIXL's pull
mode); failures counted as NIXL counts them. What NIXL has no word for keeps its own name
(``pull_seconds``: what decode waits per request; the side-channel and integrity counters).
No two families count the same thing.

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
XFER_BUCKETS = SECONDS_BUCKETS[1:]  # NIXL's transfer time starts at 5 ms
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
    FAILED_NOTIFICATIONS = "num_failed_notifications"
    EXPIRED_LEASES = "num_kv_expired_reqs"
    NOTIFICATIONS_AFTER_EXPIRY = "num_notifications_after_expiry"
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
    Family("xfer_time", "vllm:flagcx_xfer_time_seconds", Kind.HISTOGRAM,
           "Seconds of one transfer's data movement (one prefill rank's write for one "
           "pull, timed on prefill)", "decode", XFER_BUCKETS),
    Family("post_time", "vllm:flagcx_post_time_seconds", Kind.HISTOGRAM,
           "Seconds of one transfer outside its data movement and check: the pull "
           "message's round trip and prefill's queue", "decode", SECONDS_BUCKETS),
    Family("bytes_transferred", "vllm:flagcx_bytes_transferred", Kind.HISTOGRAM,
           "Bytes of KV moved per transfer", "decode", BYTES_BUCKETS),
    Family("num_descriptors", "vllm:flagcx_num_descriptors", Kind.HISTOGRAM,
           "Descriptors (contiguous runs) written per transfer", "decode",
           DESCRIPTOR_BUCKETS),
    Family("pull_seconds", "vllm:flagcx_pull_seconds", Kind.HISTOGRAM,
           "Seconds decode waited per request, from its first pull message to the KV "
           "landed and checked (every prefill rank)", "decode", SECONDS_BUCKETS),
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
    Family("num_failed_transfers", "vllm:flagcx_num_failed_transfers", Kind.COUNTER,
           "Requests whose KV did not arrive whole, at any stage (handshake, pull, "
           "check): vLLM recomputes or fails them", "decode"),
    Family("num_failed_notifications", "vllm:flagcx_num_failed_notifications",
           Kind.COUNTER, "Release messages prefill never confirmed (decode gave the blocks "
           "back after release_hold_seconds)", "decode"),
    Family("num_kv_expired_reqs", "vllm:flagcx_num_kv_expired_reqs", Kind.COUNTER,
           "Requests whose KV prefill freed unpulled when their lease expired", "prefill"),
    Family("num_notifications_after_expiry", "vllm:flagcx_num_notifications_after_expiry",
           Kind.COUNTER, "Pulls and releases that reached prefill after the transfer's "
           "lease expired (decode was too late: its blocks were freed)", "prefill"),
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

# vLLM's NixlConnector families (vLLM 0.34, ``kv_connector/v1/nixl/stats.py``) that exist
# here as ``vllm:flagcx_<suffix>`` with the same meaning and kind: a NIXL dashboard works
# after replacing ``vllm:nixl_`` with ``vllm:flagcx_``.
NIXL_FAMILIES = ("xfer_time_seconds", "post_time_seconds", "bytes_transferred",
                 "num_descriptors", "num_failed_transfers", "num_failed_notifications",
                 "num_kv_expired_reqs", "num_notifications_after_expiry")


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
