"""End-to-end integrity checks of a pull: the bytes the plan named arrived (byte sample),
and every element decode received means what prefill sent (the full logical digest).

FlagCX's ``BatchWriteSync`` can return success when RDMA slices failed, so success from
the transport is not proof. Prefill picks up to ``max_samples`` descriptors spread over
the plan, checksums the last ``sample_bytes`` of each in its SOURCE memory, and sends the
destination ranges with the checksum in the pull reply; decode checksums the same ranges
of its own memory after the reply. The tail of a descriptor is what a lost slice misses
first. Cost: a few KiB read per request. Device memory is read through the CUDA driver
(16 small device-to-host copies); where no CUDA driver is (other vendors' device memory)
the check is skipped, and decode says so once. Only where no full digest is sent (below):
the digest covers every byte the sample would.

The byte sample cannot see a plan that names the wrong bytes (it compares what the plan
moved with itself). The full logical digest can (``layout.digest``): prefill computes,
per layer, one 64-bit digest of every element it writes into the pulling rank, keyed by
what each element means (layer, part, global unit, token, word), from vLLM's own views of
its cache (``compat.kv_views``), and sends them in its reply; decode computes the same
over its own blocks after that rank replied (its write is complete then) and fails the
request on any difference, naming the KV cache group and layer range. Prefill digests
before its reply (the blocks may be reused right after); decode's is on the pull's
critical path: ``benchmarks/b2d_integrity.py`` measures both.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_flagcx.connector.common.host_cpus import unpin_this_thread
from vllm_flagcx.layout import bounds, digest, plans

if TYPE_CHECKING:
    from vllm_flagcx.connector.common.registration import Registration
    from vllm_flagcx.connector.common.worker_settings import WorkerSettings

logger = logging.getLogger("vllm_flagcx")

# reads (address, size) ranges, all at once: one synchronisation for a whole sample on a GPU
Reader = Callable[[Sequence[tuple[int, int]]], list[bytes]]

SAMPLE_BYTES = 64
MAX_SAMPLES = 16


def sample_ranges(src: np.ndarray, dst: np.ndarray, length: np.ndarray,
                  max_samples: int = MAX_SAMPLES, sample_bytes: int = SAMPLE_BYTES
                  ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(source ranges, destination ranges) of the sample: descriptor tails, spread out."""
    if src.size == 0:
        return [], []
    picks = np.unique(np.linspace(0, src.size - 1, min(max_samples, src.size)).astype(int))
    n = np.minimum(length[picks].astype(np.int64), sample_bytes)
    end_src = src[picks].astype(np.int64) + length[picks].astype(np.int64)
    end_dst = dst[picks].astype(np.int64) + length[picks].astype(np.int64)
    return ([(int(e - k), int(k)) for e, k in zip(end_src, n, strict=True)],
            [(int(e - k), int(k)) for e, k in zip(end_dst, n, strict=True)])


def outside(ranges: list[tuple[int, int]], spans: Sequence[tuple[int, int]],
            max_sample_bytes: int = SAMPLE_BYTES) -> tuple[int, int] | None:
    """The first (address, size) of ``ranges`` not inside one of ``spans`` (this side's
    registered storages, ``regions.unique_storages``), or of a size the sample never
    has; None when all are inside.

    The ranges arrive in prefill's reply: reading them unchecked let a rogue prefill make
    decode read any address (measured: SIGSEGV)."""
    for address, size in ranges:
        if not 0 < size <= max_sample_bytes:
            return address, size
    addresses = np.asarray([a for a, _ in ranges], dtype=np.int64)
    sizes = np.asarray([n for _, n in ranges], dtype=np.int64)
    i = bounds.first_outside(addresses, sizes, spans)
    return None if i is None else ranges[i]


def read_host(ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    return [ctypes.string_at(address, size) for address, size in ranges]


def reader(host_memory: bool) -> Reader | None:
    """How to read the KV caches' bytes: host memory directly, device memory through the
    CUDA driver; None when neither is possible (the check is then skipped)."""
    if host_memory:
        return read_host
    from vllm_flagcx.transport import cuda_ipc

    cuda = cuda_ipc.driver()
    return cuda.read_many if cuda is not None else None


def build_kernels(address: int) -> None:
    """Compile the CUDA kernels (the same-host copies, the gather, the digest) for the
    device holding ``address`` now, at registration: built on first use they cost the
    first request NVRTC's compile. Nothing where no CUDA driver is (other vendors)."""
    from vllm_flagcx.transport import cuda_ipc

    cuda = cuda_ipc.driver()
    if cuda is not None and cuda.is_device(address):
        cuda.has_kernel(cuda.device_of(address))


def checksum(ranges: list[tuple[int, int]], read: Reader = read_host) -> int:
    """crc32 over memory ranges, in order."""
    crc = 0
    for piece in read(ranges):
        crc = zlib.crc32(piece, crc)
    return crc


_KERNEL_CHECKED: dict[int, bool] = {}  # device ordinal -> the kernel agreed with torch


def layer_digests(views: Mapping[str, Any], block_ids: Sequence[Sequence[int]],
                  me: tuple[int, int], peer: tuple[int, int], sending: bool
                  ) -> dict[str, int]:
    """``compat.kv_views.layer_digests``; on a CUDA device one kernel launch for the whole
    request (``transport.cuda_kernel``: the torch path launches ~8 small kernels per part,
    ~1,000 for Qwen3.6 at TP 1). The kernel's first answer on each device is compared with
    the torch path's; a disagreement is logged and the kernel is not used again there."""
    from vllm_flagcx.compat import kv_views

    first = next(iter(views.values())).parts[0].view if views else None
    if first is None or first.device.type != "cuda" or _KERNEL_CHECKED.get(
            first.get_device()) is False:
        return kv_views.layer_digests(views, block_ids, me, peer, sending)
    from vllm_flagcx.transport import cuda_ipc

    ordinal = int(first.get_device())
    tiles = kv_views.digest_tiles(views, block_ids, me, peer, sending)
    cuda = cuda_ipc.driver()
    sums = cuda.digest(ordinal, tiles[1], tiles[2], len(tiles[0])) \
        if tiles is not None and tiles[0] and cuda is not None else None
    if sums is None or tiles is None:  # no kernel, or a part it cannot tile
        return kv_views.layer_digests(views, block_ids, me, peer, sending)
    got = dict(zip(tiles[0], (int(x) for x in sums.tolist()), strict=True))
    if ordinal not in _KERNEL_CHECKED:
        agreed = got == kv_views.layer_digests(views, block_ids, me, peer, sending)
        _KERNEL_CHECKED[ordinal] = agreed
        if not agreed:
            logger.error("FlagCX digest kernel disagrees with the torch digest on CUDA "
                         "device %d: using the torch path", ordinal)
            return kv_views.layer_digests(views, block_ids, me, peer, sending)
    return got


def paired_sender_ids(sender_ids: list[list[int]], receiver_ids: list[list[int]],
                      offsets: list[int | None]) -> tuple[tuple[int, ...], ...]:
    """Per KV cache group, the sender's blocks a pull pairs with its receiver's, in the
    transfer's pair order (what the sender's digest covers)."""
    return tuple(tuple(int(b) for b in plans.align_block_ids(
        s, r, offsets[g] if offsets else None)[0])
        for g, (s, r) in enumerate(zip(sender_ids, receiver_ids, strict=True)))


def sender_digests(views: Mapping[str, Any], paired: Sequence[Sequence[int]],
                   me: tuple[int, int], peer: tuple[int, int]) -> tuple[tuple[str, int], ...]:
    """Prefill: per layer, the digest of everything this rank (``me``: rank, TP) writes
    into ``peer`` for this pull, over its ``paired`` blocks (``paired_sender_ids``)."""
    if not views:
        return ()
    return tuple(layer_digests(views, paired, me, peer, sending=True).items())


def receiver_mismatch(views: Mapping[str, Any], digests: Sequence[tuple[str, int]],
                      block_ids: list[list[int]], me: tuple[int, int],
                      peer: tuple[int, int]) -> str | None:
    """Decode, after ``peer`` (rank, TP) replied: why this rank's blocks do not hold what
    that prefill rank sent (a refused reply, a missing layer, a differing digest named by
    group and layer range), or None."""
    uncovered = next((p for v in views.values() for p in v.parts
                      if not digest.covers_receiver(peer[1], me, p.global_units,
                                                    p.replicated)), None)
    if uncovered is not None:
        return (f"the prefill ranks of TP {peer[1]} do not each write a disjoint share of "
                f"this rank's {uncovered.name} units: the transfer cannot be proven")
    expected = layer_digests(views, block_ids, me, peer, sending=False)
    groups = {name: int(v.group) for name, v in views.items()}
    return digest.mismatch(digests, expected, groups)


Digests = tuple[tuple[str, int], ...]  # (layer range, digest) as a reply carries them
DigestKey = tuple[tuple[int, int], tuple[tuple[int, ...], ...]]  # (peer rank, TP), paired
EarlyDigests = dict[DigestKey, "Future[Digests]"]  # one transfer's digests started at arm
MAX_PAIRINGS = 8  # pairings remembered: TP 1 -> 8 gives each prefill rank 8 receivers


@dataclass(frozen=True)
class Pairing:
    """How one receiver rank's pull paired this rank's blocks, per KV cache group, as a
    rule for the next transfer: every block (``ALL``), the last ``n`` (a window or a
    state: ``("last", n, 0)``), or all but ``head`` leading and ``tail`` trailing ones (a
    prefix decode held: ``("cut", head, tail)``)."""

    peer: tuple[int, int]  # the receiver's (rank, TP)
    rules: tuple[tuple[str, int, int], ...]

    ALL = ("all", 0, 0)

    @classmethod
    def of(cls, peer: tuple[int, int], sender_ids: list[list[int]],
           receiver_ids: list[list[int]], offsets: list[int | None]) -> Pairing:
        rules = []
        for g, (ids, got) in enumerate(zip(sender_ids, receiver_ids, strict=True)):
            offset = offsets[g] if offsets else None
            if len(got) == len(ids) and not offset:
                rules.append(cls.ALL)
            elif offset is None:
                rules.append(("last", len(got), 0))
            else:
                rules.append(("cut", offset, len(ids) - offset - len(got)))
        return cls(peer, tuple(rules))

    def paired(self, sender_ids: list[list[int]]) -> tuple[tuple[int, ...], ...] | None:
        """The rule applied to another transfer's blocks (None: too few of them)."""
        if len(sender_ids) != len(self.rules):
            return None
        out = []
        for ids, (kind, a, b) in zip(sender_ids, self.rules, strict=True):
            head, tail = {"all": (0, 0), "last": (len(ids) - a, 0)}.get(kind, (a, b))
            if head < 0 or tail < 0 or head + tail > len(ids):
                return None
            out.append(tuple(ids[head:len(ids) - tail]))
        return tuple(out)


class DigestsAhead:
    """Prefill's digests started when a transfer is armed, not when decode's pull asks.

    Why: in the router's sequential mode decode pulls 5-10 ms after prefill finished (the
    router, decode's API, its scheduler), and the digest of what a pull writes (0.5-2.6 ms
    on an H100 from 1k to 32k tokens, ~1.2 ms on 2 CPU cores) sat on the pull's path, after
    the write. The digest depends on the receiver (its rank and TP pick the slices) and on
    the pairing (a prefix decode already holds is not sent), known only from a pull: each
    new transfer is digested, on one background thread, for the pairings the latest pulls
    had (``MAX_PAIRINGS``). A pull whose pairing was not foreseen digests its own, as before;
    one whose digest is still running waits for it (no slower than computing it). The
    blocks stay held while armed and no step writes a finished request's blocks, so an
    early digest equals a late one (decode's check compares them with its own)."""

    def __init__(self, settings: WorkerSettings, registration: Registration) -> None:
        self._settings = settings
        self._registration = registration
        self._pairings: OrderedDict[Pairing, None] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def learn(self, pairing: Pairing) -> None:
        """Remember a pull's pairing for the transfers armed after it."""
        with self._lock:
            self._pairings[pairing] = None
            self._pairings.move_to_end(pairing)
            while len(self._pairings) > MAX_PAIRINGS:
                self._pairings.popitem(last=False)

    @property
    def pairings(self) -> list[Pairing]:
        with self._lock:
            return list(self._pairings)

    def start(self, block_ids: Sequence[Sequence[int]], into: EarlyDigests) -> None:
        """At arm: a transfer's digest (``block_ids``: its blocks) for every pairing seen
        lately, in the background, kept in ``into`` (the transfer's own)."""
        if not self._settings.verify_integrity or not self._registration.views:
            return
        sender_ids = [list(g) for g in block_ids]
        for pairing in self.pairings:
            paired = pairing.paired(sender_ids)
            if paired is None or (pairing.peer, paired) in into:
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, initializer=unpin_this_thread,
                                                thread_name_prefix="flagcx-digest-ahead")
            into[(pairing.peer, paired)] = self._pool.submit(
                self.digest, paired, pairing.peer)

    def digest(self, paired: tuple[tuple[int, ...], ...], peer: tuple[int, int]) -> Digests:
        s = self._settings
        return sender_digests(self._registration.views, paired, (s.tp_rank, s.tp_size), peer)

    @staticmethod
    def take(early: EarlyDigests, key: DigestKey) -> Digests | None:
        """The digest started at arm for this pull, waited for if it is running; None when
        none was started for it, it still waits in the queue (a burst of arms: the pull is
        faster digesting its own than queueing behind the others) or it failed."""
        future = early.pop(key, None)
        if future is None or future.cancel() or future.cancelled():
            return None
        try:
            return future.result()
        except Exception as exc:  # the pull's own attempt reports what fails
            logger.debug("FlagCX digest started at arm failed: %s", exc)
            return None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
