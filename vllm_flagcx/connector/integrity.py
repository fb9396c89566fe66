"""End-to-end integrity checks of a pull: the bytes the plan named arrived (byte sample),
and they mean the same on both sides (logical sample).

FlagCX's ``BatchWriteSync`` can return success when RDMA slices failed, so success from
the transport is not proof. Prefill picks up to ``max_samples`` descriptors spread over
the plan, checksums the last ``sample_bytes`` of each in its SOURCE memory, and sends the
destination ranges with the checksum in the pull reply; decode checksums the same ranges
of its own memory after the reply. The tail of a descriptor is what a lost slice misses
first. Cost: a few KiB read per request. Device memory is read through the CUDA driver
(16 small device-to-host copies); where no CUDA driver is (other vendors' device memory)
the check is skipped, and decode says so once.

The byte sample cannot see a plan that names the wrong bytes (it compares what the plan
moved with itself). The logical sample can: prefill picks (layer, block, token, head) keys
(``layout.logical.sample_keys``), reads each element where the tensor's own strides put it
(``compat.kv_views``: one read of every element through the byte sample's reader, or
torch's indexing where there is none) and sends a crc per key; decode refuses keys it may not read
(``layout.logical.refuse_keys``), reads the same elements of its own blocks, and fails the
request on the first difference, naming it. Both samples are read by prefill before its
reply (the blocks may be reused right after) and by decode after every prefill rank
replied (each rank's write is complete when it replies); decode's read is on the pull's
critical path: ``benchmarks/b2d_integrity.py`` measures both.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from vllm_flagcx.layout import bounds, logical, plans
from vllm_flagcx.layout.logical import LogicalKey
from vllm_flagcx.layout.topology import head_range

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


def checksum(ranges: list[tuple[int, int]], read: Reader = read_host) -> int:
    """crc32 over memory ranges, in order."""
    crc = 0
    for piece in read(ranges):
        crc = zlib.crc32(piece, crc)
    return crc


LogicalEntry = tuple[str, int, int, int, int]  # (layer, receiver block, token, head, crc)


def _local(layers: list[tuple[Any, list[tuple[int, int, int]], int]],
           read: Reader | None) -> list[list[int]]:
    """Per (view, [(logical block, token, global head)], first head of this rank): the
    crcs of those elements, all layers read at once (``kv_views.crcs_batched``: through
    ``read`` where it can, else torch's indexing)."""
    from vllm_flagcx.compat.kv_views import crcs_batched

    lookups = []
    for view, keys, first_head in layers:
        located = [logical.locate(b, t, view.ratio, view.kernel_block_size)
                   for b, t, _ in keys]
        lookups.append((view, [k for k, _ in located], [s for _, s in located],
                        [h - first_head for _, _, h in keys]))
    return crcs_batched(lookups, read)


def logical_sample(views: Mapping[str, Any], sender_ids: list[list[int]],
                   receiver_ids: list[list[int]], offsets: list[int | None],
                   rank: int, tp: int, peer_rank: int, peer_tp: int,
                   read: Reader | None = None) -> tuple[LogicalEntry, ...]:
    """Prefill: the keys of this (rank, peer rank) pair with the crc of each as THIS side
    holds it. Empty when the two ranks share no head or no block."""
    if not views:
        return ()
    pairs = [plans.align_block_ids(s, r, offsets[g] if offsets else None)
             for g, (s, r) in enumerate(zip(sender_ids, receiver_ids, strict=True))]
    facts = {name: v.facts for name, v in views.items()}
    global_heads = next(iter(facts.values())).global_heads
    mine = head_range(rank, tp, global_heads)
    heads = logical.shared_heads(mine, head_range(peer_rank, peer_tp, global_heads))
    picked = logical.sample_keys(facts, pairs, heads)
    names = list(dict.fromkeys(k.layer for k, _ in picked))
    rows = {name: [(k, s) for k, s in picked if k.layer == name] for name in names}
    crcs = _local([(views[name], [(s, k.token, k.head) for k, s in rows[name]],
                    head_range(rank, tp, views[name].facts.global_heads)[0])
                   for name in names], read)
    return tuple((k.layer, k.block, k.token, k.head, c)
                 for name, layer_crcs in zip(names, crcs, strict=True)
                 for (k, _), c in zip(rows[name], layer_crcs, strict=True))


def logical_mismatch(views: Mapping[str, Any], entries: list[LogicalEntry],
                     block_ids: list[list[int]], rank: int, tp: int,
                     read: Reader | None = None, max_keys: int = logical.MAX_KEYS
                     ) -> str | None:
    """Decode: why the request's bytes are not prefill's (a refused key or the first
    differing element), or None when every key matches. ``max_keys``: the keys the
    replies may carry together (``logical.MAX_KEYS`` per prefill rank that answered)."""
    if not views or not entries:
        return None
    keys = [LogicalKey(str(e[0]), int(e[1]), int(e[2]), int(e[3])) for e in entries]
    facts = {name: v.facts for name, v in views.items()}
    global_heads = next(iter(facts.values())).global_heads
    own = head_range(rank, tp, global_heads)
    refusal = logical.refuse_keys(keys, facts, block_ids, own, max_keys)
    if refusal is not None:
        return refusal
    names = list(dict.fromkeys(k.layer for k in keys))
    rows = {name: [(k, int(e[4])) for k, e in zip(keys, entries, strict=True)
                   if k.layer == name] for name in names}
    got = _local([(views[name], [(k.block, k.token, k.head) for k, _ in rows[name]],
                   head_range(rank, tp, views[name].facts.global_heads)[0])
                  for name in names], read)
    for name, layer_got in zip(names, got, strict=True):
        for (key, want), have in zip(rows[name], layer_got, strict=True):
            if want != have:
                return (f"logical integrity check failed at {key.layer} block {key.block} "
                        f"token {key.token} KV head {key.head}: decode holds other data than "
                        "prefill sent (the transfer plan named the wrong bytes)")
    return None
