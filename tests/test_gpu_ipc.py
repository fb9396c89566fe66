"""GPU memory between two processes on one GPU through the same-host transport (CUDA IPC).

Needs CUDA (skipped elsewhere; CI has no GPU). Run on the GPU machine with
``python3 -m pytest tests/test_gpu_ipc.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from testkit import peers

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def decode_gpu():
    nbytes = 64 << 20
    with peers.spawned(peers.gpu_decode_side, nbytes, start_timeout=120, stop="stop") as (
            conn, (desc, base)):
        yield conn, desc, base, nbytes


def test_gpu_bytes_land_across_processes(decode_gpu):
    from vllm_flagcx.transport.local import LocalTransport

    conn, desc, d_base, nbytes = decode_gpu
    block = 1 << 16
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    p = LocalTransport()
    p.register(src.data_ptr(), nbytes)
    assert p.device_ranges and not p.ranges  # recognised as device memory
    p_ids = np.array([3, 4, 5, 6, 40, 100, 7, 900], dtype=np.uint64)
    d_ids = np.array([10, 11, 12, 13, 2, 90, 0, 901], dtype=np.uint64)
    result = p.write(p.connect(desc), src.data_ptr() + p_ids * block,
                     d_base + d_ids * block, np.full(p_ids.size, block, dtype=np.uint64))
    assert result.ok, result.error
    conn.send("bytes")
    got = np.frombuffer(conn.recv(), dtype=np.uint8).reshape(-1, block)
    want = src.cpu().numpy().reshape(-1, block)
    for pb, db in zip(p_ids.tolist(), d_ids.tolist(), strict=True):
        np.testing.assert_array_equal(got[db], want[pb])
    assert not got[[1, 8, 500]].any()
    outside = p.write(p.connect(desc), np.array([src.data_ptr()], dtype=np.uint64),
                      np.array([d_base + nbytes], dtype=np.uint64),
                      np.array([16], dtype=np.uint64))
    assert not outside.ok and "outside the GPU memory" in outside.error


@pytest.fixture
def decode_gpu_in_pieces():
    nbytes = 48 << 20
    with peers.spawned(peers.gpu_decode_side, nbytes, 3, start_timeout=120, stop="stop") as (
            conn, (desc, base)):
        yield conn, desc, base, nbytes


def _host_checks_forbidden(monkeypatch):
    """The checked kernel's path must not fall back on the host's bounds pass."""
    from vllm_flagcx.layout.bounds import RangeTable

    def forbidden(*_args, **_kwargs):
        raise AssertionError("host bounds check ran on the checked-kernel path")

    monkeypatch.setattr(RangeTable, "holds", forbidden)
    monkeypatch.setattr(RangeTable, "locate", forbidden)


def test_the_checked_kernel_maps_each_destination_by_its_region(decode_gpu_in_pieces,
                                                                   monkeypatch):
    """16 descriptors over the peer's 3 registered regions and 2 allocations of this
    process: every block lands where its region's mapping puts it, and the host never
    searched a range table."""
    from vllm_flagcx.transport.local import LocalTransport

    conn, desc, d_base, nbytes = decode_gpu_in_pieces
    block, n = 1 << 16, 16
    rng = np.random.default_rng(11)
    halves = [torch.randint(0, 256, (nbytes // 2,), dtype=torch.uint8, device="cuda")
              for _ in range(2)]
    p = LocalTransport()
    for half in halves:
        p.register(half.data_ptr(), half.numel())
    handle = p.connect(desc)
    _host_checks_forbidden(monkeypatch)
    which = np.arange(n) % 2
    s_ids = rng.permutation(nbytes // 2 // block)[:n]
    d_ids = rng.permutation(nbytes // block)[:n]
    s_addr = np.array([halves[w].data_ptr() + int(i) * block
                       for w, i in zip(which, s_ids, strict=True)], dtype=np.uint64)
    result = p.write(handle, s_addr, d_base + d_ids.astype(np.uint64) * np.uint64(block),
                     np.full(n, block, dtype=np.uint64))
    assert result.ok, result.error
    conn.send("bytes")
    got = np.frombuffer(conn.recv(), dtype=np.uint8).reshape(-1, block)
    for w, si, di in zip(which.tolist(), s_ids.tolist(), d_ids.tolist(), strict=True):
        np.testing.assert_array_equal(got[di], halves[w].cpu().numpy().reshape(-1, block)[si])


@pytest.mark.parametrize("bad", ["destination past the end", "destination across pieces",
                                 "length that wraps", "source outside"])
def test_the_checked_kernel_refuses_a_descriptor_outside(decode_gpu_in_pieces, monkeypatch,
                                                         bad):
    from vllm_flagcx.transport.local import LocalTransport

    _, desc, d_base, nbytes = decode_gpu_in_pieces
    block, n = 4096, 32
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    p = LocalTransport()
    p.register(src.data_ptr(), nbytes)
    handle = p.connect(desc)
    _host_checks_forbidden(monkeypatch)
    s_addr = src.data_ptr() + np.arange(n, dtype=np.uint64) * np.uint64(block)
    d_addr = d_base + np.arange(n, dtype=np.uint64) * np.uint64(block)
    length = np.full(n, block, dtype=np.uint64)
    piece = nbytes // 3
    if bad == "destination past the end":
        d_addr[n // 2] = d_base + nbytes - block // 2
    elif bad == "destination across pieces":
        d_addr[n // 2] = d_base + piece - block // 2
    elif bad == "length that wraps":
        length[n // 2] = np.uint64((1 << 64) - 16)
    else:
        s_addr[n // 2] = src.data_ptr() + nbytes
    result = p.write(handle, s_addr, d_addr, length)
    assert not result.ok
    # a wrapped length lies outside both sides; the source is named first
    side = {"source outside": "source outside",
            "length that wraps": "source outside"}.get(bad, "outside the GPU memory")
    assert side in result.error, result.error
    # the same batch without the bad descriptor goes through
    keep = np.arange(n) != n // 2
    assert p.write(handle, s_addr[keep], d_addr[keep], length[keep]).ok


def _write_and_fetch(decode_gpu, src, s_addr, d_addr, length):
    from vllm_flagcx.transport.local import LocalTransport

    conn, desc, _, nbytes = decode_gpu
    p = LocalTransport()
    p.register(src.data_ptr(), nbytes)
    result = p.write(p.connect(desc), s_addr, d_addr, length)
    assert result.ok, result.error
    conn.send("bytes")
    return np.frombuffer(conn.recv(), dtype=np.uint8)


def _scattered(decode_gpu, n, block, rng):
    _, _, d_base, nbytes = decode_gpu
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    p_ids = rng.permutation(nbytes // block)[:n].astype(np.uint64)
    d_ids = rng.permutation(nbytes // block)[:n].astype(np.uint64)
    return src, src.data_ptr() + p_ids * np.uint64(block), d_base + d_ids * np.uint64(block)


def test_many_descriptors_take_the_batched_kernel(decode_gpu):
    from vllm_flagcx.transport import cuda_ipc

    _, _, d_base, _ = decode_gpu
    block, n = 4096, 5000
    src, s_addr, d_addr = _scattered(decode_gpu, n, block, np.random.default_rng(3))
    got = _write_and_fetch(decode_gpu, src, s_addr, d_addr, np.full(n, block, dtype=np.uint64))
    want = src.cpu().numpy()
    s_off = (s_addr - np.uint64(src.data_ptr())).astype(np.int64)
    d_off = (d_addr - np.uint64(d_base)).astype(np.int64)
    np.testing.assert_array_equal(got.reshape(-1, block)[d_off // block],
                                  want.reshape(-1, block)[s_off // block])
    assert cuda_ipc.driver()._kernels.get(torch.cuda.current_device()) is not None


def test_a_side_channel_thread_writes_with_the_kernel_it_builds(decode_gpu, monkeypatch):
    """Prefill writes from side-channel threads, which never made a CUDA context current:
    the first write of a fresh driver, from such a thread, builds the kernels there and
    takes the checked kernel (a build without a current context failed for good, and
    every write of that engine copied one descriptor at a time: 9-77 ms on an H100 B5)."""
    import threading

    from vllm_flagcx.transport import cuda_ipc

    fresh = cuda_ipc.CudaDriver()
    monkeypatch.setattr(cuda_ipc, "driver", lambda: fresh)
    _host_checks_forbidden(monkeypatch)
    from vllm_flagcx.transport.local import LocalTransport

    conn, desc, d_base, nbytes = decode_gpu
    block, n = 4096, 64
    src, s_addr, d_addr = _scattered(decode_gpu, n, block, np.random.default_rng(13))
    torch.cuda.synchronize()
    p = LocalTransport()
    p.register(src.data_ptr(), nbytes)  # at startup, on the engine's own thread
    results = []
    writer = threading.Thread(target=lambda: results.append(p.write(
        p.connect(desc), s_addr, d_addr, np.full(n, block, dtype=np.uint64))))
    writer.start()
    writer.join(120)
    assert results and results[0].ok, results or "the write raised (the thread's traceback)"
    conn.send("bytes")
    got = np.frombuffer(conn.recv(), dtype=np.uint8)
    s_off = (s_addr - np.uint64(src.data_ptr())).astype(np.int64) // block
    d_off = (d_addr - np.uint64(d_base)).astype(np.int64) // block
    np.testing.assert_array_equal(got.reshape(-1, block)[d_off],
                                  src.cpu().numpy().reshape(-1, block)[s_off])


def test_registration_builds_the_kernels_before_any_request(monkeypatch):
    """``integrity.build_kernels`` (called where the connector registers its caches)
    compiles them: a request's first write or digest never waits for NVRTC."""
    from vllm_flagcx.connector.common import integrity
    from vllm_flagcx.transport import cuda_ipc, cuda_kernel

    fresh = cuda_ipc.CudaDriver()
    monkeypatch.setattr(cuda_ipc, "driver", lambda: fresh)
    cache = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    integrity.build_kernels(cache.data_ptr())

    def no_compile(*_args, **_kwargs):
        raise AssertionError("NVRTC compiled after registration")

    monkeypatch.setattr(cuda_kernel, "compile_cubin", no_compile)
    assert fresh.has_kernel(torch.cuda.current_device())
    integrity.build_kernels(torch.empty(8).data_ptr())  # host memory: nothing to build


def test_batched_kernel_copies_unaligned_and_uneven_descriptors(decode_gpu):
    _, _, d_base, _ = decode_gpu
    rng = np.random.default_rng(5)
    block, n = 8192, 300
    src, s_addr, d_addr = _scattered(decode_gpu, n, block, rng)
    skew = rng.integers(0, 16, n).astype(np.uint64)  # byte-path descriptors
    skew[::3] = 0  # every third one 16-byte aligned
    length = rng.integers(1, block - 16, n).astype(np.uint64)
    length[::3] = length[::3] // 16 * 16 + 16
    got = _write_and_fetch(decode_gpu, src, s_addr + skew, d_addr + skew, length)
    want = src.cpu().numpy()
    for s, d, k in zip((s_addr + skew - np.uint64(src.data_ptr())).tolist(),
                       (d_addr + skew - np.uint64(d_base)).tolist(), length.tolist(),
                       strict=True):
        np.testing.assert_array_equal(got[d:d + k], want[s:s + k])


def test_memcpy_path_when_the_kernel_is_switched_off(decode_gpu, monkeypatch):
    from vllm_flagcx.transport import cuda_ipc

    monkeypatch.setenv(cuda_ipc.BATCHED_ENV, "0")
    _, _, d_base, _ = decode_gpu
    block, n = 4096, 100
    src, s_addr, d_addr = _scattered(decode_gpu, n, block, np.random.default_rng(9))
    got = _write_and_fetch(decode_gpu, src, s_addr, d_addr, np.full(n, block, dtype=np.uint64))
    s_off = (s_addr - np.uint64(src.data_ptr())).astype(np.int64) // block
    d_off = (d_addr - np.uint64(d_base)).astype(np.int64) // block
    np.testing.assert_array_equal(got.reshape(-1, block)[d_off],
                                  src.cpu().numpy().reshape(-1, block)[s_off])


def test_integrity_checksum_reads_device_memory():
    import zlib

    from vllm_flagcx.connector.common import integrity

    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    read = integrity.reader(host_memory=False)
    assert read is not None
    ranges = [(data.data_ptr() + 1000, 64), (data.data_ptr() + (1 << 19), 17)]
    host = data.cpu().numpy()
    want = zlib.crc32(host[1000:1064].tobytes())
    want = zlib.crc32(host[1 << 19:(1 << 19) + 17].tobytes(), want)
    assert integrity.checksum(ranges, read) == want
    data[1000 + 63] ^= 1
    assert integrity.checksum(ranges, read) != want


def test_many_ranges_are_read_by_one_gather_and_land_in_order():
    """From BATCH_MIN ranges on, ``read_many`` packs them with the batched kernel: odd
    sizes and unaligned starts included, each piece is exactly its range's bytes."""
    from vllm_flagcx.transport import cuda_ipc

    cuda = cuda_ipc.driver()
    assert cuda is not None
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    host = data.cpu().numpy()
    starts = [0, 17, 4096, 9000, 65536 + 3, 300_000, 500_001, 777_777, 1_000_000, 123]
    sizes = [64, 5, 256, 1, 64, 333, 16, 48, 4096, 7]
    assert len(starts) >= cuda_ipc.BATCH_MIN
    got = cuda.read_many([(data.data_ptr() + a, n) for a, n in zip(starts, sizes,
                                                                   strict=True)])
    assert got == [host[a:a + n].tobytes() for a, n in zip(starts, sizes, strict=True)]


def test_a_range_over_two_allocations_is_exported_per_allocation():
    """vLLM's KV tensors are separate allocations, often back to back, and the connector
    registers adjacent storages as one span: each allocation needs its own IPC handle."""
    from vllm_flagcx.transport import cuda_ipc

    size = 64 << 20
    a = torch.empty(size, dtype=torch.uint8, device="cuda")
    b = torch.empty(size, dtype=torch.uint8, device="cuda")
    cuda = cuda_ipc.driver()
    first, second = sorted((a.data_ptr(), b.data_ptr()))
    base_first, len_first = cuda.allocation(first)
    if base_first + len_first != cuda.allocation(second)[0]:
        pytest.skip("the two allocations are not adjacent here")
    start = first
    end = cuda.allocation(second)[0] + cuda.allocation(second)[1]
    pieces = cuda_ipc.describe_device(start, end - start)
    assert [p["base"] for p in pieces] == [base_first, base_first + len_first]
    assert sum(p["size"] for p in pieces) == end - start
    assert pieces[0]["handle"] != pieces[1]["handle"]


def test_the_checked_kernel_refuses_more_regions_than_it_holds():
    """A region count above MAX_REGIONS (``region_table`` never builds one) is refused by
    the kernel itself, before it touches shared memory, and nothing is copied."""
    from vllm_flagcx.transport import cuda_ipc, cuda_kernel

    src = torch.randint(1, 256, (1 << 16,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    cuda = cuda_ipc.driver()
    ordinal = torch.cuda.current_device()
    assert cuda.has_kernel(ordinal)
    n = 16
    d_addr = dst.data_ptr() + np.arange(n, dtype=np.uint64) * np.uint64(4096)
    s_addr = src.data_ptr() + np.arange(n, dtype=np.uint64) * np.uint64(4096)
    length = np.full(n, 4096, dtype=np.uint64)
    regions = cuda_kernel.region_table(
        np.array([[src.data_ptr(), src.data_ptr() + src.numel()]], np.uint64),
        np.array([[dst.data_ptr(), dst.data_ptr() + dst.numel(), 0]], np.uint64))
    assert cuda.copy_checked(ordinal, d_addr, s_addr, length, regions, 1, 1) == (False, False)
    assert torch.equal(dst, src)  # the same call within bounds copies everything
    dst.zero_()
    too_many = cuda_kernel.MAX_REGIONS + 1
    assert cuda.copy_checked(ordinal, d_addr, s_addr, length, regions, too_many, 1) == (
        True, True)
    torch.cuda.synchronize()
    assert not dst.any()
