"""End-to-end integrity check: a checksum over a sample of what prefill wrote.

FlagCX's ``BatchWriteSync`` can return success when RDMA slices failed, so success from
the transport is not proof. Prefill picks up to ``max_samples`` descriptors spread over
the plan, checksums the last ``sample_bytes`` of each in its SOURCE memory, and sends the
destination ranges with the checksum in the pull reply; decode checksums the same ranges
of its own memory after the reply. The tail of a descriptor is what a lost slice misses
first. Cost: a few KiB read per request. Device memory is read through the CUDA driver
(16 small device-to-host copies); where no CUDA driver is (other vendors' device memory)
the check is skipped, and decode says so once.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable

import numpy as np

from vllm_flagcx.layout import plans

Reader = Callable[[int, int], bytes]

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


def outside(ranges: list[tuple[int, int]], spans: list[tuple[int, int]],
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
    i = plans.first_outside(addresses, sizes, spans)
    return None if i is None else ranges[i]


def read_host(address: int, size: int) -> bytes:
    return ctypes.string_at(address, size)


def reader(host_memory: bool) -> Reader | None:
    """How to read the KV caches' bytes: host memory directly, device memory through the
    CUDA driver; None when neither is possible (the check is then skipped)."""
    if host_memory:
        return read_host
    from vllm_flagcx.transport import cuda_ipc

    cuda = cuda_ipc.driver()
    return cuda.read if cuda is not None else None


def checksum(ranges: list[tuple[int, int]], read: Reader = read_host) -> int:
    """crc32 over memory ranges, in order."""
    crc = 0
    for address, size in ranges:
        crc = zlib.crc32(read(address, size), crc)
    return crc
