"""End-to-end integrity check: a checksum over a sample of what prefill wrote.

FlagCX's ``BatchWriteSync`` can return success when RDMA slices failed, so success from
the transport is not proof. Prefill picks up to ``max_samples`` descriptors spread over
the plan, checksums the last ``sample_bytes`` of each in its SOURCE memory, and sends the
destination ranges with the checksum in the pull reply; decode checksums the same ranges
of its own memory after the reply. The tail of a descriptor is what a lost slice misses
first. Cost: a few KiB read per request. Host memory only (device memory would need a copy
kernel): decode skips the check for device caches and says so once.
"""

from __future__ import annotations

import ctypes
import zlib

import numpy as np

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


def checksum(ranges: list[tuple[int, int]]) -> int:
    """crc32 over host memory ranges, in order."""
    crc = 0
    for address, size in ranges:
        crc = zlib.crc32(ctypes.string_at(address, size), crc)
    return crc
