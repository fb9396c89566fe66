"""A worker's settings: what one TP rank of a prefill or decode instance runs with.

Built by ``entry.FlagCXConnector`` from the validated ``ConnectorSettings`` (the user's
``kv_connector_extra_config``) and the engine's own facts (engine id, TP rank and size,
the layout); frozen, so the threads of a worker all read the same values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm_flagcx.connector.settings import ConnectorSettings
from vllm_flagcx.wire import handshake as hs

# Every default a user can set is ConnectorSettings' (its one statement of each); the
# worker only adds what it alone needs (peer_ttl, peer_probe_seconds, host_memory, ...).
_USER = ConnectorSettings()


@dataclass(frozen=True)
class WorkerSettings:
    engine_id: str
    tp_rank: int
    tp_size: int
    layout: hs.LayoutFacts
    bind_host: str = _USER.bind_host
    side_channel_port: int = _USER.side_channel_port  # P: base; rank r listens on base + r
    handshake_timeout: float = _USER.handshake_timeout
    recv_timeout: float = _USER.pull_timeout  # longer than the prefill lease
    lease_seconds: float = _USER.lease_seconds
    skip_compat_hash: bool = not _USER.enforce_handshake_compat
    peer_ttl: float = 300.0  # re-handshake a cached prefill after this long (restarts)
    peer_probe_seconds: float = 1.0  # while waiting on prefill, check it still listens
    verify_integrity: bool = _USER.verify_integrity  # checksum a sample of every transfer
    write_start_timeout: float = _USER.write_start_timeout
    release_hold_seconds: float = _USER.release_hold_seconds
    host_memory: bool = True  # the KV caches are host memory (else device: read via CUDA)
    test_faults: bool = _USER.test_faults  # honour kv_transfer_params.flagcx_test_fault
    log_timelines: bool = _USER.log_timelines  # one wire.timeline line per load at INFO
    incarnation: str = field(default_factory=lambda: f"{time.time_ns():x}")
    key: bytes | None = field(default=None, repr=False)  # side-channel MAC key (auth)
