"""A worker's settings: what one TP rank of a prefill or decode instance runs with.

Built by ``entry.FlagCXConnector`` from the validated ``ConnectorSettings`` (the user's
``kv_connector_extra_config``) and the engine's own facts (engine id, TP rank and size,
the layout); frozen, so the threads of a worker all read the same values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm_flagcx.connector.common.settings import DEFAULTS
from vllm_flagcx.wire import handshake as hs


@dataclass(frozen=True)
class WorkerSettings:
    engine_id: str
    tp_rank: int
    tp_size: int
    layout: hs.LayoutFacts
    bind_host: str = DEFAULTS.bind_host
    side_channel_port: int = DEFAULTS.side_channel_port  # P: base; rank r listens on base + r
    handshake_timeout: float = DEFAULTS.handshake_timeout
    recv_timeout: float = DEFAULTS.pull_timeout  # longer than the prefill lease
    lease_seconds: float = DEFAULTS.lease_seconds
    skip_compat_hash: bool = not DEFAULTS.enforce_handshake_compat
    peer_ttl: float = 300.0  # re-handshake a cached prefill after this long (restarts)
    peer_probe_seconds: float = 1.0  # while waiting on prefill, check it still listens
    verify_integrity: bool = DEFAULTS.verify_integrity  # checksum a sample of every transfer
    write_start_timeout: float = DEFAULTS.write_start_timeout
    release_hold_seconds: float = DEFAULTS.release_hold_seconds
    idle_step_wait_seconds: float = DEFAULTS.idle_step_wait_seconds
    host_memory: bool = True  # the KV caches are host memory (else device: read via CUDA)
    test_faults: bool = DEFAULTS.test_faults  # honour kv_transfer_params.flagcx_test_fault
    log_timelines: bool = DEFAULTS.log_timelines  # one wire.timeline line per load at INFO
    incarnation: str = field(default_factory=lambda: f"{time.time_ns():x}")
    key: bytes | None = field(default=None, repr=False)  # side-channel MAC key (auth)
