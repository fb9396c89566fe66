"""The batched GPU copy's pure parts (launch shape, NVRTC lookup) and the integrity
check's memory readers; the kernel itself runs in ``test_gpu_ipc.py`` on a GPU."""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest

from vllm_flagcx.connector.common import integrity
from vllm_flagcx.transport import cuda_kernel


def test_few_large_descriptors_are_split_across_warps():
    assert cuda_kernel.launch_shape(140, 1_274_000) == (cuda_kernel.MAX_SPLIT, 18)
    assert cuda_kernel.launch_shape(4, 64 << 20) == (cuda_kernel.MAX_SPLIT, 1)
    split, _ = cuda_kernel.launch_shape(10, 3 * cuda_kernel.BYTES_PER_SPLIT)
    assert split == 3
    assert cuda_kernel.launch_shape(10, 3 * cuda_kernel.BYTES_PER_SPLIT + 1)[0] == 4


def test_many_small_descriptors_get_one_warp_each_up_to_the_grid_limit():
    assert cuda_kernel.WARPS == cuda_kernel.THREADS // 32
    assert cuda_kernel.launch_shape(20_910, 8_448) == (2, 2_614)  # 8 descriptors a block
    assert cuda_kernel.launch_shape(8, 512) == (1, 1)
    assert cuda_kernel.launch_shape(9, 512) == (1, 2)
    assert cuda_kernel.launch_shape(10**7, 512) == (1, cuda_kernel.MAX_GRID_Y)


def test_missing_nvrtc_is_named(monkeypatch):
    monkeypatch.setattr(cuda_kernel, "_nvrtc_candidates", lambda: ["/nonexistent/libnvrtc.so"])
    with pytest.raises(cuda_kernel.KernelUnavailable, match="NVRTC"):
        cuda_kernel.load_nvrtc()


def test_host_reader_checksums_host_memory():
    data = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    read = integrity.reader(host_memory=True)
    address = data.ctypes.data
    ranges = [(address + 100, 64), (address + 4000, 50)]
    want = zlib.crc32(data[4000:4050].tobytes(), zlib.crc32(data[100:164].tobytes()))
    assert integrity.checksum(ranges, read) == want
    data[4049] ^= 0xFF
    assert integrity.checksum(ranges, read) != want


def test_checksum_goes_through_the_given_reader():
    seen = []

    def reader(ranges: list[tuple[int, int]]) -> list[bytes]:
        seen.append(list(ranges))  # one call for the whole sample
        return [ctypes.string_at(ctypes.addressof(buf) + a, n) for a, n in ranges]

    buf = (ctypes.c_ubyte * 256)(*range(256))
    assert integrity.checksum([(10, 4), (200, 8)], reader) == zlib.crc32(
        bytes(range(200, 208)), zlib.crc32(bytes(range(10, 14))))
    assert seen == [[(10, 4), (200, 8)]]


def test_per_thread_buffers_grow_never_shrink_and_free_the_old_one():
    """The descriptor table and its pinned staging share one grow rule (checked here
    without a GPU: ``_grown`` takes the allocator)."""
    import threading

    copy = object.__new__(cuda_kernel.BatchedCopy)
    copy._local = threading.local()
    allocated, freed = [], []

    def alloc(capacity):
        allocated.append(capacity)
        return 1000 + len(allocated)

    assert copy._grown("t", 10, alloc, freed.append) == 1001
    assert allocated == [1 << 16]  # the floor
    assert copy._grown("t", 1 << 16, alloc, freed.append) == 1001 and not freed
    assert copy._grown("t", (1 << 16) + 1, alloc, freed.append) == 1002
    assert allocated[-1] == 1 << 17 and freed == [1001]  # doubled, old one released
    assert copy._grown("t", 5, alloc, freed.append) == 1002  # never shrinks
    assert copy._grown("other", 5, alloc, freed.append) == 1003  # buffers are separate
