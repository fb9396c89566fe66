"""Worker half of FlagCXConnector: side channel, pulls, writes, failures.

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
from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_flagcx.connector import fault_knobs, integrity
from vllm_flagcx.connector.host_cpus import allowed_cpus
from vllm_flagcx.connector.scheduler import FlagCXMetadataPayload, RecvTask, SendTask
from vllm_flagcx.layout import plans
from vllm_flagcx.layout.regions import Region, Section, unique_storages
from vllm_flagcx.transport.base import Transport
from vllm_flagcx.wire import auth, client
from vllm_flagcx.wire import handshake as hs

logger = logging.getLogger("vllm_flagcx")

# Where a decode-side receive can fail. (Registration fails at startup, loudly; a failed
# prefill-side write reaches decode as a failed pull reply; both are counted in stats.)
STAGES = ("handshake", "recv")


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
    host_memory: bool = True  # the KV caches are host memory (else device: read via CUDA)
    test_faults: bool = False  # honour kv_transfer_params.flagcx_test_fault (tests only)
    incarnation: str = field(default_factory=lambda: f"{time.time_ns():x}")
    key: bytes | None = field(default=None, repr=False)  # side-channel MAC key (auth)


MAX_PARKED_PULLS = 1024  # pulls for transfers not armed yet, per side channel
MAX_TP = 1024
MAX_ENDED_REMEMBERED = 4096  # ended transfer ids kept to answer late pulls at once
MAX_WRITES_IN_FLIGHT = 64  # per prefill rank; more pulls stay parked
MAX_FRAME_BYTES = 16 << 20  # a larger side-channel frame drops its connection


SLOW_HANDSHAKE_SECONDS = 1.0


def pull_problem(pull: hs.PullRequest, num_groups: int) -> str:
    """What makes a pull unservable before any plan is made ("" when nothing): the
    receiver's TP rank and size, the group count and the block ids it names (a pull
    crosses a process boundary: its fields are untrusted)."""
    sheet = pull.sheet
    if not 1 <= sheet.tp_size <= MAX_TP or not 0 <= sheet.tp_rank < sheet.tp_size:
        return (f"receiver tp_rank {sheet.tp_rank} / tp_size {sheet.tp_size} is not a TP "
                "position")
    if len(pull.block_ids) != num_groups:
        return f"{len(pull.block_ids)} block-id groups named, this model has {num_groups}"
    if pull.offsets and len(pull.offsets) != num_groups:
        return f"{len(pull.offsets)} offsets named, this model has {num_groups} groups"
    if any(b < 0 or b >= 1 << 31 for group in pull.block_ids for b in group):
        return "a block id outside 0 .. 2**31"
    return ""


def unpin_this_thread() -> None:
    """Let this side-channel thread run on any CPU this host allows (``allowed_cpus``).

    vLLM's CPU worker pins its main thread (and so every thread it starts later) to one
    core shared with its OpenMP compute threads; a side-channel thread there starved for
    seconds behind busy engines (handshakes timed out). Best effort: a cgroup may forbid
    it, and then the thread keeps the worker's affinity.
    """
    if not hasattr(os, "sched_setaffinity"):
        return
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, allowed_cpus())


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """This thread unpinned for the block, its affinity restored after.

    For what starts threads of its own from the worker's main thread: a ZMQ context's
    I/O thread inherits the affinity of the thread that creates its first socket, and one
    pinned to the OpenMP core answered a first handshake after more than 5 s on a busy
    2-core CI machine (measured: the decode gave up and recomputed).
    """
    saved = None
    if hasattr(os, "sched_getaffinity"):
        with contextlib.suppress(OSError):
            saved = os.sched_getaffinity(0)
    unpin_this_thread()
    try:
        yield
    finally:
        if saved is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, saved)


def _delta(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


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


class FailureLedger:
    """Failed requests with their blocks, by stage; drained once per engine step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failed: dict[str, tuple[str, str, list[int]]] = {}
        self.counts: dict[str, int] = defaultdict(int)
        self.recent: deque[tuple[float, str, str, str]] = deque(maxlen=256)  # for operators
        self._last_counts: dict[str, int] = {}

    def record(self, stage: str, request_id: str, block_ids: list[int], error: str) -> None:
        assert stage in STAGES, stage
        with self._lock:
            if request_id in self._failed:
                return  # the first failure is the one reported
            self._failed[request_id] = (stage, error, list(block_ids))
            self.counts[stage] += 1
            self.recent.append((time.monotonic(), stage, request_id, error))
        logger.warning("FlagCX %s failure for request %s: %s", stage, request_id, error)

    def take_counts(self) -> dict[str, int]:
        """Failures by stage since the previous call (for stats)."""
        with self._lock:
            delta = _delta(self.counts, self._last_counts)
            self._last_counts = dict(self.counts)
        return delta

    def drain(self) -> tuple[set[str], set[int]]:
        with self._lock:
            failed, self._failed = self._failed, {}
        return set(failed), {b for _, _, ids in failed.values() for b in ids}


def _to_info(region: Region) -> hs.RegionInfo:
    return hs.RegionInfo(region.name, region.layer, region.group, region.kind, region.base,
                         region.block_stride, region.num_blocks, region.block_bytes,
                         tuple(_section_info(s) for s in region.sections))


def _section_info(s: Section) -> hs.SectionInfo:
    return hs.SectionInfo(s.name, s.offset, s.units, s.unit_bytes, s.global_units, s.repeats,
                          s.repeat_stride, s.replicated)


def receiver_spans(sheet: hs.FactSheet) -> list[tuple[int, int]]:
    """The disjoint (address, size) storages a receiver's sheet announces."""
    return unique_storages([(r.base, r.block_stride * r.num_blocks) for r in sheet.regions])


def _from_info(info: hs.RegionInfo) -> Region:
    return Region(info.name, info.layer, info.group, info.kind, info.base, info.block_stride,
                  info.num_blocks, info.block_bytes,
                  tuple(Section(*msgspec.structs.astuple(s)) for s in info.sections))


@dataclass
class _Armed:
    task: SendTask
    expected: set[int] | None = None  # receiver ranks, known at the first pull
    pulled: set[int] = field(default_factory=set)
    writes: int = 0  # writes under way: the lease cannot expire, a Release must wait
    receiver: str | None = None  # engine id of the decode instance that pulls it
    release_waiters: list[bytes] = field(default_factory=list)  # Releases to ack after


class WorkerHalf:
    """One per worker process (TP rank). Thread-safe between the runner and its threads."""

    def __init__(self, settings: WorkerSettings, transport: Transport) -> None:
        self.settings = settings
        self.transport = transport
        self.ledger = FailureLedger()
        self.regions: list[Region] = []
        self.kernel_ratios: list[int] = []
        self.sheet: hs.FactSheet | None = None
        self._lock = threading.Lock()
        self._armed: dict[str, _Armed] = {}  # transfer_id -> held send
        self._parked: list[tuple[bytes, hs.PullRequest, float]] = []
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._peer_sheets: dict[tuple[str, int], tuple[float, hs.FactSheet]] = {}
        self._connections: dict[str, object] = {}
        self._plan_tables: dict[tuple[str, int], plans.PlanTable] = {}
        self._receivers: dict[tuple[str, int], hs.FactSheet] = {}  # pinned at first pull
        # Transfers that ended here (released, expired): a late pull for one is answered
        # at once. Before, it waited a lease for an id that would never be armed (a
        # sibling decode rank failed and released: the other rank waited ~30 s).
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._connect_lock = threading.Lock()
        # Writes run on writer threads, never on the side-channel thread (one slow write
        # stalled every handshake, heartbeat and release behind it); their replies come
        # back through the outbox, and a byte on the wake pipe tells the server thread.
        self._writer: ThreadPoolExecutor | None = None
        self._writes_in_flight = 0
        self._outbox: deque[tuple[bytes, hs.Message]] = deque()
        self._wake_r, self._wake_w = -1, -1
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        self._pull_threads: list[threading.Thread] = []
        self.stats: dict[str, float] = defaultdict(float)
        self._last_stats: dict[str, float] = {}
        self._pending_invalid: set[int] = set()
        self._storages: list[tuple[int, int]] = []  # registered (address, size), disjoint
        self.failed_last_step: set[str] = set()
        self._zmq = None
        self._read_kv = (integrity.reader(settings.host_memory)
                         if settings.verify_integrity else None)

    # ---------------------------------------------------------------- registration
    def register_regions(self, regions: list[Region], serve: bool,
                         logical_num_blocks: int | None = None) -> None:
        self.kernel_ratios = kernel_ratios(regions, len(self.settings.layout.block_sizes),
                                           logical_num_blocks)
        spans = unique_storages([(r.base, r.end - r.base) for r in regions])
        for address, size in spans:
            self.transport.register(address, size)
        self._storages = spans
        self.regions = list(regions)
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
        with self._lock:
            for task in payload.send.values():
                if task.transfer_id in self._armed:  # the scheduler refuses these first
                    self._done_sending.add(task.request_id)
                    continue
                self._armed[task.transfer_id] = _Armed(task)
        for task in payload.recv.values():
            self._spawn(self._pull_guarded, task)
        for transfer_id, remote in payload.release.items():
            self._spawn(self._release, transfer_id, remote, self.settings.handshake_timeout)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving); failed receives are finished too, with
        their blocks held for ``get_block_ids_with_load_errors`` of the same step."""
        self._expire_leases()
        failed, blocks = self.ledger.drain()
        with self._lock:
            self._pending_invalid |= blocks
            self.failed_last_step = failed
            sending, self._done_sending = self._done_sending, set()
            recving, self._done_recving = self._done_recving, set()
        return sending, recving | failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            invalid, self._pending_invalid = self._pending_invalid, set()
        return invalid

    def _spawn(self, fn: Any, *args: Any) -> None:
        def run() -> None:
            unpin_this_thread()
            fn(*args)

        thread = threading.Thread(target=run, daemon=True, name="flagcx-pull")
        thread.start()
        self._pull_threads = [t for t in self._pull_threads if t.is_alive()] + [thread]

    # ---------------------------------------------------------------- decode side
    def _ask(self, host: str, port: int, message: hs.Message, timeout: float) -> hs.Message:
        import zmq

        with self._lock:  # pull threads start at once; one context for all
            if self._zmq is None:
                self._zmq = zmq.Context()
        return client.ask(self._zmq, host, port, message, timeout,
                          probe_every=self.settings.peer_probe_seconds, key=self.settings.key)

    def _remote_sheet(self, host: str, port: int) -> hs.FactSheet:
        key = (host, port)
        cached = self._peer_sheets.get(key)
        if cached is None or time.monotonic() - cached[0] > self.settings.peer_ttl:
            started = time.monotonic()
            reply = self._ask(host, port, hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0),
                              self.settings.handshake_timeout)
            took = time.monotonic() - started
            if took > SLOW_HANDSHAKE_SECONDS:
                logger.warning("FlagCX handshake with prefill %s:%d took %.1f s (a busy or "
                               "CPU-starved prefill worker answers late)", host, port, took)
            if isinstance(reply, hs.HandshakeRefused):
                raise hs.HandshakeError(f"prefill at {host}:{port} refused: {reply.reason}")
            if not isinstance(reply, hs.HandshakeReply):
                raise hs.HandshakeError(f"unexpected handshake answer {type(reply).__name__}")
            self._peer_sheets[key] = (time.monotonic(), reply.sheet)
        return self._peer_sheets[key][1]

    def _pull_guarded(self, task: RecvTask) -> None:
        """``_pull``, and whatever it raises (a bug, a value nobody checked) fails the
        request: a pull thread that died silently left its request waiting forever with
        its blocks."""
        try:
            self._pull(task)
        except Exception as exc:
            flat = [b for g in task.block_ids for b in g]
            error = f"internal error in the pull: {type(exc).__name__}: {exc}"
            try:
                self._fail_after_release(task, flat, error)
            except Exception:
                self.ledger.record("recv", task.request_id, flat, error)

    def _pull(self, task: RecvTask) -> None:
        flat = [b for g in task.block_ids for b in g]
        remote = task.remote
        started = time.monotonic()
        try:
            fault = fault_knobs.requested_fault(remote.test_fault, self.settings.test_faults)
        except fault_knobs.FaultKnobError as exc:
            self._fail_after_release(task, flat, str(exc))
            return
        if fault == "drop_all":
            self._release(remote.transfer_id, remote, self.settings.handshake_timeout)
            with self._lock:
                self._done_recving.add(task.request_id)
            return
        try:
            p_sheet = self._remote_sheet(remote.remote_host, remote.remote_port)
            hs.check_compatible(self.sheet, p_sheet, skip_hash=self.settings.skip_compat_hash)
        except (hs.HandshakeError, TimeoutError, OSError) as exc:
            self._peer_sheets.pop((remote.remote_host, remote.remote_port), None)
            self.ledger.record("handshake", task.request_id, flat, str(exc))
            if isinstance(exc, hs.HandshakeError):  # P is reachable: let it free now
                self._release(remote.transfer_id, remote, self.settings.handshake_timeout)
            return
        # Every P rank is asked, also those holding nothing for this rank (replicated
        # heads): they answer at once, and each P rank then knows when all D ranks pulled.
        senders = range(p_sheet.tp_size)
        request = hs.PullRequest(remote.transfer_id, self.sheet,
                                 tuple(tuple(g) for g in task.block_ids),
                                 tuple(task.offsets))
        total = 0
        for p_rank in senders:
            try:
                reply = self._ask(remote.remote_host, remote.remote_port + p_rank, request,
                                  self.settings.recv_timeout)
            except (TimeoutError, OSError, hs.HandshakeError) as exc:
                self._fail_after_release(task, flat, f"P rank {p_rank}: {exc}")
                return
            if not isinstance(reply, hs.PullReply) or not reply.ok:
                error = getattr(reply, "error", type(reply).__name__)
                self._fail_after_release(task, flat, f"P rank {p_rank}: {error}")
                return
            if reply.sample and self._integrity_checked():
                stray = integrity.outside(list(reply.sample), self._storages)
                if stray is not None:
                    self._fail_after_release(task, flat, (
                        f"P rank {p_rank}: the reply's integrity sample names {stray[1]} "
                        f"bytes at {stray[0]:#x}, outside this worker's KV caches"))
                    return
                got = integrity.checksum(list(reply.sample), self._read_kv)
                if got != reply.sample_crc:
                    self.stats["integrity_failures"] += 1
                    self._fail_after_release(task, flat, (
                        f"P rank {p_rank}: integrity check failed (crc {got:#x} != "
                        f"{reply.sample_crc:#x}): the transport reported success but bytes "
                        "did not land"))
                    return
            total += reply.num_bytes
        if fault == "corrupt_block":
            fault_knobs.corrupt_first_block(self.regions, task.block_ids,
                                            self.settings.host_memory)
        with self._lock:
            self._done_recving.add(task.request_id)
            self.stats["recv_bytes"] += total
            self.stats["recv_seconds"] += time.monotonic() - started
            self.stats["recv_requests"] += 1

    def _integrity_checked(self) -> bool:
        if not self.settings.verify_integrity:
            return False
        if self._read_kv is None:
            if not self.stats.get("integrity_skipped_device"):
                logger.info("FlagCX integrity check skipped: device memory that the CUDA "
                            "driver cannot read")
            self.stats["integrity_skipped_device"] = 1
            return False
        return True

    def _fail_after_release(self, task: RecvTask, flat: list[int], error: str) -> None:
        """Fail a pull only once prefill confirmed no write into these blocks is in flight.

        A pull that timed out may still be written by a slow prefill; reporting it now
        would let vLLM reuse the blocks under that write. Each prefill rank handles its
        side channel in order, so its Ack to the Release comes after any write it had
        under way. The wait is bounded by the lease, and ends at once when prefill's port
        refuses connections (its worker, the writer, is gone: ``client.PeerGoneError``).
        """
        confirmed = self._release(task.remote.transfer_id, task.remote,
                                  self.settings.lease_seconds)
        if not confirmed:
            error += "; prefill did not confirm that no write is in flight"
        self.ledger.record("recv", task.request_id, flat, error)

    def _release(self, transfer_id: str, remote: Any, timeout: float) -> bool:
        """Tell every prefill rank to drop ``transfer_id``; True when each acknowledged
        or is gone (its port refuses connections: nothing left there to write)."""
        try:
            p_sheet = self._remote_sheet(remote.remote_host, remote.remote_port)
            for p_rank in range(p_sheet.tp_size):
                try:
                    self._ask(remote.remote_host, remote.remote_port + p_rank,
                              hs.Release(transfer_id), timeout)
                except client.PeerGoneError:
                    continue
        except (hs.HandshakeError, TimeoutError, OSError) as exc:
            # Prefill frees the blocks at lease expiry anyway.
            logger.info("release of %s not acknowledged (%s); the prefill lease frees it",
                        transfer_id, exc)
            return False
        return True

    # ---------------------------------------------------------------- prefill side
    def _start_server(self) -> None:
        import zmq

        auth.require_secret_off_loopback(self.settings.bind_host, self.settings.key)
        with unpinned():  # the context's I/O thread starts with the first socket
            self._zmq = self._zmq or zmq.Context()
            sock = self._zmq.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        port = self.settings.side_channel_port + self.settings.tp_rank
        sock.bind(f"tcp://{self.settings.bind_host}:{port}")
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._writer = ThreadPoolExecutor(
            max_workers=max(1, int(getattr(self.transport, "max_concurrent_writes", 1))),
            thread_name_prefix=f"flagcx-write-{port}", initializer=unpin_this_thread)
        self._server = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                        name=f"flagcx-side-channel-{port}")
        self._server.start()

    def _serve(self, sock: Any) -> None:
        import zmq

        unpin_this_thread()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(20))
                if events.get(sock):
                    self._serve_one(sock)
                if events.get(self._wake_r):
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                for ident, reply in self._serve_parked():
                    sock.send_multipart([ident, b"", self._seal(reply)])
                while self._outbox:
                    ident, reply = self._outbox.popleft()
                    sock.send_multipart([ident, b"", self._seal(reply)])
        finally:
            sock.close()

    def _post(self, ident: bytes, reply: hs.Message) -> None:
        """Queue an answer for the server thread (the only one that touches the socket)."""
        self._outbox.append((ident, reply))
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"w")

    def _serve_one(self, sock: Any) -> None:
        """One message from the side channel; nothing a peer sends may end the server
        thread (a malformed frame list or any error is answered or dropped, and counted)."""
        frames = sock.recv_multipart()
        if len(frames) != 3 or frames[1] != b"":
            self.stats["malformed_messages"] += 1
            return  # not a REQ envelope: nobody to answer
        ident, _, frame = frames
        try:
            data = auth.unseal(self.settings.key, frame)
        except auth.AuthError as exc:  # answered bare: the sender may lack the key
            self.stats["unauthenticated_messages"] += 1
            if self.stats["unauthenticated_messages"] in (1, 10, 100, 1000):
                logger.warning("FlagCX side channel: refused %d unauthenticated message(s) "
                               "so far: %s", self.stats["unauthenticated_messages"], exc)
            sock.send_multipart([ident, b"", hs.encode(hs.HandshakeRefused(str(exc)))])
            return
        try:
            reply = self._handle(ident, data)
        except Exception as exc:  # a bug or a hostile message: answer, keep serving
            self.stats["malformed_messages"] += 1
            logger.warning("FlagCX side channel: message refused: %s: %s",
                           type(exc).__name__, exc)
            reply = hs.HandshakeRefused(f"refused: {type(exc).__name__}")
        if reply is not None:
            sock.send_multipart([ident, b"", self._seal(reply)])

    def _seal(self, message: hs.Message) -> bytes:
        return auth.seal(self.settings.key, hs.encode(message))

    def _handle(self, ident: bytes, data: bytes) -> hs.Message | None:
        try:
            message = hs.decode(data)
        except hs.HandshakeError as exc:
            return hs.HandshakeRefused(str(exc))
        if isinstance(message, hs.HandshakeRequest):
            self.stats["handshakes_served"] += 1
            if message.protocol_version != hs.PROTOCOL_VERSION:
                return hs.HandshakeRefused(
                    f"protocol_version: local {hs.PROTOCOL_VERSION}, remote "
                    f"{message.protocol_version}")
            return hs.HandshakeReply(self.sheet)
        if isinstance(message, hs.Heartbeat):
            renewed = time.monotonic() + self.settings.lease_seconds
            with self._lock:
                for tid in message.transfer_ids:
                    armed = self._armed.get(tid)
                    if armed is not None and armed.task.deadline < renewed:
                        armed.task.deadline = renewed
                        self.stats["lease_renewals"] += 1
            return hs.Ack(",".join(message.transfer_ids)[:256])
        if isinstance(message, hs.Release):
            with self._lock:
                armed = self._armed.get(message.transfer_id)
                if armed is not None and armed.writes:  # ack once no write is in flight
                    if len(armed.release_waiters) < 16:
                        armed.release_waiters.append(ident)
                    return None
                if self._armed.pop(message.transfer_id, None) is not None:
                    self._done_sending.add(armed.task.request_id)
                    self._end(message.transfer_id, "released by decode")
            return hs.Ack(message.transfer_id)
        if isinstance(message, hs.PullRequest):
            problem = pull_problem(message, len(self.settings.layout.block_sizes))
            if problem:
                return hs.PullReply(message.transfer_id, False, problem)
            with self._lock:
                if len(self._parked) >= MAX_PARKED_PULLS:
                    return hs.PullReply(message.transfer_id, False,
                                        f"more than {MAX_PARKED_PULLS} pulls wait here")
                self._parked.append((ident, message,
                                     time.monotonic() + self.settings.lease_seconds))
            return None
        return hs.HandshakeRefused(f"unexpected message {type(message).__name__}")

    def _serve_parked(self) -> list[tuple[bytes, hs.Message]]:
        now = time.monotonic()
        out, keep = [], []
        with self._lock:
            parked, self._parked = self._parked, []
        for ident, pull, deadline in parked:
            with self._lock:
                armed = self._armed.get(pull.transfer_id)
                if armed is not None and armed.receiver not in (None, pull.sheet.engine_id):
                    out.append((ident, hs.PullReply(
                        pull.transfer_id, False, "this transfer is pulled by another decode "
                        "instance")))
                    continue
                if armed is not None and self._writes_in_flight >= MAX_WRITES_IN_FLIGHT:
                    keep.append((ident, pull, deadline))  # writer threads all busy
                    continue
                if armed is not None:
                    armed.writes += 1
                    armed.receiver = pull.sheet.engine_id
                    self._writes_in_flight += 1
            if armed is None:
                with self._lock:
                    ended = self._ended.get(pull.transfer_id)
                if ended is not None:
                    out.append((ident, hs.PullReply(pull.transfer_id, False,
                                                    f"transfer ended here: {ended}")))
                elif now > deadline:
                    out.append((ident, hs.PullReply(pull.transfer_id, False,
                                                    "unknown or expired transfer id")))
                else:
                    keep.append((ident, pull, deadline))
                continue
            assert self._writer is not None
            self._writer.submit(self._write_job, ident, armed, pull)
        with self._lock:
            self._parked = keep + self._parked
        return out

    def _write_job(self, ident: bytes, armed: _Armed, pull: hs.PullRequest) -> None:
        try:
            reply = self._write(armed, pull)
        except Exception as exc:  # _write ends the pull itself; this is the last guard
            logger.warning("FlagCX write for %s: %s: %s", pull.transfer_id,
                           type(exc).__name__, exc)
            reply = hs.PullReply(pull.transfer_id, False, f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._writes_in_flight -= 1
        self._post(ident, reply)

    def _write(self, armed: _Armed, pull: hs.PullRequest) -> hs.PullReply:
        started = time.monotonic()
        try:
            hs.check_compatible(self.sheet, pull.sheet, skip_hash=self.settings.skip_compat_hash)
            receiver = self._receiver_sheet(pull.sheet)
            plan = self._plan_table(receiver).plan(
                armed.task.block_ids, pull.block_ids, self.kernel_ratios or None,
                list(pull.offsets) or None)
            plans.check_within(plan, self._storages, receiver_spans(receiver))
            if plan.num_descriptors == 0:  # this rank holds none of the receiver's bytes
                self._finish_pull(armed, pull, failed=False)
                return hs.PullReply(pull.transfer_id, True)
            handle = self._connection(receiver)
            result = self.transport.write(handle, plan.src, plan.dst, plan.length)
        except Exception as exc:  # whatever a pull names, the transfer ends and is freed
            self._connections.pop(pull.sheet.incarnation, None)
            self._finish_pull(armed, pull, failed=True)
            return hs.PullReply(pull.transfer_id, False, f"{type(exc).__name__}: {exc}")
        if not result.ok:
            self._connections.pop(pull.sheet.incarnation, None)
            self._finish_pull(armed, pull, failed=True)
            return hs.PullReply(pull.transfer_id, False, result.error)
        with self._lock:
            self.stats["send_bytes"] += plan.num_bytes
            self.stats["send_descriptors"] += plan.num_descriptors
            self.stats["send_seconds"] += time.monotonic() - started
        sample, crc = (), 0
        if self.settings.verify_integrity and self._read_kv is not None:
            # Read before the pull ends: the blocks may be freed (and reused) right after.
            try:
                src_ranges, dst_ranges = integrity.sample_ranges(plan.src, plan.dst,
                                                                 plan.length)
                sample, crc = tuple(dst_ranges), integrity.checksum(src_ranges, self._read_kv)
            except Exception as exc:  # the bytes moved; only the proof of it is lost
                logger.warning("FlagCX integrity sample of %s not taken: %s",
                               pull.transfer_id, exc)
        self._finish_pull(armed, pull, failed=False)
        return hs.PullReply(pull.transfer_id, True, "", plan.num_bytes, plan.num_descriptors,
                            sample, crc)

    def _receiver_sheet(self, sheet: hs.FactSheet) -> hs.FactSheet:
        """The receiver's sheet as its first pull named it: an incarnation's regions and
        transport (the process written into) are pinned then, and a later pull that
        names others is refused (HandshakeError)."""
        key = (sheet.incarnation, sheet.tp_rank)
        with self._lock:
            pinned = self._receivers.get(key)
            if pinned is None:
                if len(self._receivers) >= 256:  # decode restarts: drop the stale ones
                    self._receivers.clear()
                self._receivers[key] = pinned = sheet
        if pinned != sheet:
            raise hs.HandshakeError(f"receiver incarnation {sheet.incarnation!r} rank "
                                    f"{sheet.tp_rank} names other regions or another "
                                    "transport than at its first pull")
        return pinned

    def _plan_table(self, sheet: hs.FactSheet) -> plans.PlanTable:
        """The request-independent part of plans to this receiver rank, built at its first
        pull and kept for its incarnation (a restarted decode has a new one)."""
        key = (sheet.incarnation, sheet.tp_rank)
        table = self._plan_tables.get(key)
        if table is None:
            if len(self._plan_tables) >= 256:  # decode restarts: drop the stale ones
                self._plan_tables.clear()
            pair = plans.RankPair(self.settings.tp_rank, self.settings.tp_size,
                                  sheet.tp_rank, sheet.tp_size)
            table = plans.build_table(self.regions, [_from_info(r) for r in sheet.regions],
                                      pair, num_groups=len(self.settings.layout.block_sizes))
            self._plan_tables[key] = table
        return table

    def _connection(self, sheet: hs.FactSheet) -> object:
        with self._connect_lock:  # writer threads: one connect per receiver
            handle = self._connections.get(sheet.incarnation)
            if handle is None:
                handle = self.transport.connect(sheet.transport_desc)
                self._connections[sheet.incarnation] = handle
            return handle

    def _finish_pull(self, armed: _Armed, pull: hs.PullRequest, failed: bool) -> None:
        """One pull's write is over: the transfer ends once every receiver rank pulled,
        or at once when a Release waited for this write (then acknowledged, only now)."""
        with self._lock:
            armed.writes -= 1
            if armed.expected is None:
                armed.expected = set(range(pull.sheet.tp_size))
            armed.pulled.add(pull.sheet.tp_rank)
            if failed:
                self.stats["send_failures"] += 1
            done = armed.pulled >= armed.expected or (armed.release_waiters
                                                      and armed.writes == 0)
            if done and self._armed.pop(pull.transfer_id, None):
                self._done_sending.add(armed.task.request_id)
                self._end(pull.transfer_id, "released by decode" if armed.release_waiters
                          else "already pulled by every receiver rank")
            waiters, armed.release_waiters = (
                (armed.release_waiters, []) if armed.writes == 0 else ([], armed.release_waiters))
        for ident in waiters:
            self._post(ident, hs.Ack(pull.transfer_id))

    def _end(self, transfer_id: str, why: str) -> None:
        """Remember (bounded) that ``transfer_id`` ended here; caller holds the lock."""
        self._ended[transfer_id] = why
        while len(self._ended) > MAX_ENDED_REMEMBERED:
            self._ended.popitem(last=False)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [tid for tid, a in self._armed.items()
                       if a.task.deadline < now and not a.writes]
            for tid in expired:
                self._done_sending.add(self._armed.pop(tid).task.request_id)
                self._end(tid, "its lease expired")
                self.stats["expired_leases"] += 1

    def take_stats(self) -> dict[str, float]:
        """Transfer counters since the previous call."""
        with self._lock:
            delta = _delta(self.stats, self._last_stats)
            self._last_stats = dict(self.stats)
        delta.pop("registered_storages", None)
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
        for thread in self._pull_threads:
            thread.join(timeout=0.5)
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None
        self.transport.close()
