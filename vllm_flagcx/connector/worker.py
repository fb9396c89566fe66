"""Worker half of FlagCXConnector: one object per TP rank holding the shared state of its
two roles, prefill's side-channel server (``side_channel_server``) and decode's puller
(``puller``), and the failure ledger (``ledger``).

Protocol (P pushes, D initiates; the cross-engine key is the router-minted transfer id):

1. D learns P's fact sheet from P rank 0 (``HandshakeRequest``): TP size, layout facts.
   Incompatible peers are rejected with the differing field named.
2. Each D rank sends a ``PullRequest`` (its sheet, its block ids) to every P rank; a P rank
   holding none of its bytes (replicated heads) answers at once with an empty plan.
3. A P rank parks the pull until its scheduler armed the send, plans, writes through the
   transport, and answers ``PullReply`` per request. When every expected D rank pulled, P
   reports the request in ``finished_sending`` so vLLM frees its blocks.
4. A send never pulled expires after the lease (decode heartbeats renew it); a pull not
   answered in time fails on D once P acknowledged that no write is in flight. Every
   failure goes to the ``FailureLedger`` and ends the request (single-group models: its
   blocks in ``get_block_ids_with_load_errors``; hybrids: per request), so nothing waits
   forever.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm_flagcx.connector import integrity
from vllm_flagcx.connector.ledger import STAGES, FailureLedger, _delta
from vllm_flagcx.connector.observations import Observations
from vllm_flagcx.connector.parked import ParkedPulls
from vllm_flagcx.connector.pull_clock import PullClock
from vllm_flagcx.connector.puller import Puller
from vllm_flagcx.connector.receivers import ReceiverCache
from vllm_flagcx.connector.scheduler import FlagCXMetadataPayload
from vllm_flagcx.connector.sends import Sends
from vllm_flagcx.connector.side_channel_server import (
    SideChannelServer,
)
from vllm_flagcx.connector.task_threads import TaskThreads
from vllm_flagcx.layout.regions import Region, Section, storage_spans
from vllm_flagcx.transport.base import Transport
from vllm_flagcx.wire import client
from vllm_flagcx.wire import handshake as hs

logger = logging.getLogger("vllm_flagcx")
__all__ = ["STAGES", "WorkerHalf", "WorkerSettings", "kernel_ratios", "model_page_bytes"]


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




def model_page_bytes(regions: list[Region], num_groups: int) -> tuple[int, ...]:
    """Per group, the bytes of one layer's block summed over ALL ranks (padding excluded).

    Per-rank page sizes differ whenever P and D use different TP sizes; this does not, so
    it is what the compatibility hash compares.
    """
    out = []
    for group in range(num_groups):
        layer = next((r.layer for r in regions if r.group == group), None)
        total = sum(s.global_units * s.unit_bytes * s.repeats
                    for r in regions if r.group == group and r.layer == layer
                    for s in r.sections)
        out.append(total)
    return tuple(out)


def kernel_ratios(regions: list[Region], num_groups: int, logical_num_blocks: int | None
                  ) -> list[int]:
    """Kernel blocks per logical block, per group (attention kernels may page finer than
    the KV cache manager: vLLM then allocates ``num_blocks * ratio`` kernel blocks)."""
    if not logical_num_blocks:
        return [1] * num_groups
    ratios = []
    for group in range(num_groups):
        counts = {r.num_blocks for r in regions if r.group == group} or {logical_num_blocks}
        if len(counts) != 1 or min(counts) % logical_num_blocks:
            raise ValueError(f"KV cache group {group}: regions hold {sorted(counts)} blocks, "
                             f"not one multiple of the {logical_num_blocks} logical blocks")
        ratios.append(min(counts) // logical_num_blocks)
    return ratios


def _to_info(region: Region) -> hs.RegionInfo:
    return hs.RegionInfo(region.name, region.layer, region.group, region.kind, region.base,
                         region.block_stride, region.num_blocks, region.block_bytes,
                         tuple(_section_info(s) for s in region.sections))


def _section_info(s: Section) -> hs.SectionInfo:
    return hs.SectionInfo(s.name, s.offset, s.units, s.unit_bytes, s.global_units, s.repeats,
                          s.repeat_stride, s.replicated)


class WorkerHalf(SideChannelServer, Puller):
    """One per worker process (TP rank). Thread-safe between the runner and its threads."""

    def __init__(self, settings: WorkerSettings, transport: Transport) -> None:
        self.settings = settings
        self.transport = transport
        self.ledger = FailureLedger()
        self.regions: list[Region] = []
        self.kernel_ratios: list[int] = []
        self.sheet: hs.FactSheet | None = None
        self._lock = threading.Lock()
        self.sends = Sends()  # prefill: armed transfers, their writes and how each ended
        self._parked = ParkedPulls()  # prefill: pulls that wait for an arm or a writer
        self._done_recving: set[str] = set()
        self._pull_clocks: dict[str, PullClock] = {}
        self._peer_sheets: dict[tuple[str, int], tuple[float, hs.FactSheet]] = {}
        self._connections: dict[str, object] = {}
        # (incarnation, rank) -> the receiver as its first pull named it, with its plans
        self._receivers = ReceiverCache(settings.tp_rank, settings.tp_size,
                                        len(settings.layout.block_sizes))
        self._connect_lock = threading.Lock()
        # Writes run on writer threads, never on the side-channel thread (one slow write
        # stalled every handshake, heartbeat and release behind it); their replies come
        # back through the outbox, and a byte on the wake pipe tells the server thread.
        self._writer: ThreadPoolExecutor | None = None
        self._outbox: deque[tuple[bytes, hs.Message]] = deque()
        self._wake_r, self._wake_w = -1, -1
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        # decode: pulls and releases run on kept threads (task_threads says why)
        self._tasks = TaskThreads()
        self.stats: dict[str, float] = defaultdict(float)
        self._last_stats: dict[str, float] = {}
        self.observations = Observations()  # histogram samples and gauges (wire.metrics)
        self._pending_invalid: set[int] = set()
        self._storages: list[tuple[int, int]] = []  # registered (address, size), disjoint
        self.failed_last_step: set[str] = set()
        self._zmq = None
        self._channels: client.Channels | None = None  # decode: kept side-channel connections
        self._read_kv = (integrity.reader(settings.host_memory)
                         if settings.verify_integrity else None)
        # layer -> compat.kv_views.AttentionView: the logical integrity sample's reader
        self.views: dict[str, Any] = {}

    # ---------------------------------------------------------------- registration
    def register_regions(self, regions: list[Region], serve: bool,
                         logical_num_blocks: int | None = None,
                         views: dict[str, Any] | None = None) -> None:
        """``views``: each attention layer as vLLM indexes it (``compat.kv_views``); without
        them the logical integrity sample is neither sent nor checked."""
        self.kernel_ratios = kernel_ratios(regions, len(self.settings.layout.block_sizes),
                                           logical_num_blocks)
        spans = storage_spans(regions)
        for address, size in spans:
            self.transport.register(address, size)
        self._storages = spans
        self.regions = list(regions)
        self.views = dict(views or {})
        s = self.settings
        self.sheet = hs.make_sheet(layout=s.layout, engine_id=s.engine_id,
                                   incarnation=s.incarnation, tp_size=s.tp_size,
                                   tp_rank=s.tp_rank, transport=self.transport.name,
                                   transport_desc=self.transport.describe(),
                                   regions=tuple(_to_info(r) for r in regions))
        self.stats["registered_storages"] = len(spans)
        if serve:
            self._start_server()

    # ---------------------------------------------------------------- per step
    def start_step(self, payload: FlagCXMetadataPayload) -> None:
        for task in payload.send.values():
            self.sends.arm(task)  # a duplicate transfer id: done at once (scheduler refuses)
        for task in payload.recv.values():
            self._tasks.submit(self._pull_guarded, task)
        for transfer_id, remote in payload.release.items():
            self._tasks.submit(self._release, transfer_id, remote,
                               self.settings.handshake_timeout)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving); failed receives are finished too, with
        their blocks held for ``get_block_ids_with_load_errors`` of the same step."""
        self._expire_leases()
        failed, blocks = self.ledger.drain()
        with self._lock:
            self._pending_invalid |= blocks
            self.failed_last_step = failed
            sending = self.sends.take_done()
            recving, self._done_recving = self._done_recving, set()
            clocks = [(r, self._pull_clocks.pop(r, None)) for r in recving]
        self._log_timelines(clocks)
        return sending, recving | failed

    def _log_timelines(self, clocks: list[tuple[str, PullClock | None]]) -> None:
        """One ``wire.timeline`` line per load reported now (INFO with
        ``log_timelines``, else DEBUG)."""
        level = logging.INFO if self.settings.log_timelines else logging.DEBUG
        if not clocks or not logger.isEnabledFor(level):
            return
        reported = time.monotonic()
        for request_id, clock in clocks:
            if clock is not None:
                logger.log(level, "%s", clock.line(request_id, reported))

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            invalid, self._pending_invalid = self._pending_invalid, set()
        return invalid

    def take_stats(self) -> dict[str, Any]:
        """Transfer counters since the previous call, with the histogram samples and the
        gauges of ``observations`` (the keys of ``wire.metrics``)."""
        with self._lock:
            delta: dict[str, Any] = _delta(self.stats, self._last_stats)
            self._last_stats = dict(self.stats)
        delta.pop("registered_storages", None)
        delta.update(self.observations.take(pending_sends=len(self.sends)))
        return delta

    # ---------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=2)
        if self._writer is not None:
            self._writer.shutdown(wait=True, cancel_futures=True)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = -1
        self._tasks.shutdown(timeout=2.0)
        if self._channels is not None:
            self._channels.close()
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None
        self.transport.close()
