"""A worker's settings: what one TP rank of a prefill or decode instance runs with.

Built by ``entry.FlagCXConnector`` from the validated ``ConnectorSettings`` (the user's
``kv_connector_extra_config``) and the engine's own facts (engine id, TP rank and size,
the layout); frozen, so the threads of a worker all read the same values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm_flagcx.wire import handshake as hs


@dataclass(frozen=True)
class WorkerSettings:
    engine_id: str
    tp_rank: int
    tp_size: int
    layout: hs.LayoutFacts
    bind_host: str = "127.0.0.1"
    side_channel_port: int = 0  # P: base port; rank r listens on base + r
    handshake_timeout: float = 10.0  # 5 s once ran out behind a CPU-starved prefill
    recv_timeout: float = 40.0  # longer than the prefill lease
    lease_seconds: float = 30.0
    skip_compat_hash: bool = False
    peer_ttl: float = 300.0  # re-handshake a cached prefill after this long (restarts)
    peer_probe_seconds: float = 1.0  # while waiting on prefill, check it still listens
    verify_integrity: bool = True  # checksum a sample of every transfer
    # P: a claimed write not started this long after its claim is dropped (writers busy)
    write_start_timeout: float = 5.0
    # D: after a failed pull, how long to keep the blocks while prefill has not confirmed
    # that no write into them is in flight (retrying the Release); then they go back
    release_hold_seconds: float = 600.0
    host_memory: bool = True  # the KV caches are host memory (else device: read via CUDA)
    test_faults: bool = False  # honour kv_transfer_params.flagcx_test_fault (tests only)
    log_timelines: bool = False  # one wire.timeline line per load at INFO (else DEBUG)
    incarnation: str = field(default_factory=lambda: f"{time.time_ns():x}")
    key: bytes | None = field(default=None, repr=False)  # side-channel MAC key (auth)
