"""The same-host transport's GPU write path, up to the copy: bounds checks, opening each
peer allocation once, and mapping peer addresses into this process's IPC mappings.

STAND-IN: ``_DriverStandIn`` replaces the CUDA driver (no GPU here): ``open`` answers a
made-up mapping base per IPC handle, ``copy_batch`` records what it was asked to copy, and
``copy_checked`` (the kernel that checks bounds on the device, when ``kernel`` is set)
records its region table and answers the refusal words it is told to. The copies and the
kernel's checks run on the GPU machine (tests/test_gpu_ipc.py); what is checked here is
every address and region the device would be given.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_flagcx.transport import cuda_ipc, cuda_kernel
from vllm_flagcx.transport import local as lt

MAPPED = {b"h0": 0x7000_0000_0000, b"h1": 0x7100_0000_0000}


class _DriverStandIn:
    def __init__(self) -> None:
        self.opened: list[bytes] = []
        self.copies: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def open(self, handle: bytes, device: int) -> int:
        self.opened.append(handle)
        return MAPPED[handle]

    kernel = False
    refused = (False, False)

    def copy_batch(self, device: int, dst: np.ndarray, src: np.ndarray,
                   length: np.ndarray) -> None:
        self.copies.append((dst.copy(), src.copy(), length.copy()))

    def has_kernel(self, device: int) -> bool:
        return self.kernel

    def copy_checked(self, device: int, dst: np.ndarray, src: np.ndarray, length: np.ndarray,
                     regions: np.ndarray, sources: int, destinations: int
                     ) -> tuple[bool, bool]:
        self.checked = (dst.copy(), regions.copy(), sources, destinations)
        return self.refused


@pytest.fixture
def pair(monkeypatch):
    driver = _DriverStandIn()
    monkeypatch.setattr(cuda_ipc, "driver", lambda: driver)
    me = lt.LocalTransport()
    me.device_ranges = [lt._DeviceRange(0x1000_0000, 1 << 20, 0x1000_0000, b"mine", 0)]
    me._device_table = lt._device_table(me.device_ranges)
    # two allocations of the peer; the second registered in two pieces at an offset
    peer = lt._Peer(4242, (), (
        lt._DeviceRange(0x2000_0000, 1 << 20, 0x2000_0000, b"h0", 0),
        lt._DeviceRange(0x3000_1000, 1 << 16, 0x3000_0000, b"h1", 0),
        lt._DeviceRange(0x3001_1000, 1 << 16, 0x3000_0000, b"h1", 0)))
    return me, peer, driver


def _u64(values):
    return np.array(values, dtype=np.uint64)


def test_a_batch_inside_one_allocation_maps_by_its_delta_and_opens_it_once(pair):
    me, peer, driver = pair
    src, dst = _u64([0x1000_0000, 0x1000_4000]), _u64([0x2000_0000, 0x2008_0000])
    n = _u64([64, 64])
    for _ in range(3):
        assert me._write_device(peer, src, dst, n).ok
    assert driver.opened == [b"h0"]
    mapped, copied_src, _ = driver.copies[-1]
    assert mapped.tolist() == [MAPPED[b"h0"], MAPPED[b"h0"] + 0x8_0000]
    assert copied_src.tolist() == src.tolist()


def test_a_batch_across_allocations_maps_each_descriptor_by_its_own(pair):
    me, peer, driver = pair
    dst = _u64([0x3001_1000, 0x2000_0100, 0x3000_1000])
    assert me._write_device(peer, _u64([0x1000_0000] * 3), dst, _u64([16, 16, 16])).ok
    assert sorted(driver.opened) == [b"h0", b"h1", b"h1"]  # each registered piece opened once
    mapped = driver.copies[-1][0].tolist()
    assert mapped == [MAPPED[b"h1"] + 0x1_1000, MAPPED[b"h0"] + 0x100, MAPPED[b"h1"] + 0x1000]


@pytest.mark.parametrize("dst,length,names", [
    ([0x2000_0000, 0x2010_0000], [16, 16], "destination"),  # one past the allocation
    ([0x3001_0ff0], [32], "destination"),  # across two registered pieces
    ([0x2000_0000, 0x1fff_fff0], [16, 16], "destination"),  # below the allocation
])
def test_a_destination_outside_what_the_peer_registered_is_refused(pair, dst, length, names):
    me, peer, driver = pair
    result = me._write_device(peer, _u64([0x1000_0000] * len(dst)), _u64(dst), _u64(length))
    assert not result.ok and names in result.error and "pid 4242" in result.error
    assert not driver.copies and not driver.opened


def test_a_source_outside_this_process_is_refused(pair):
    me, peer, driver = pair
    result = me._write_device(peer, _u64([0x1010_0000]), _u64([0x2000_0000]), _u64([1]))
    assert not result.ok and "source outside" in result.error
    assert not driver.copies


def _many():
    """``BATCH_MIN`` descriptors into the peer's first allocation."""
    n = cuda_ipc.BATCH_MIN
    src = _u64([0x1000_0000 + 64 * k for k in range(n)])
    dst = _u64([0x2000_0000 + 64 * k for k in range(n)])
    return src, dst, _u64([64] * n)


def test_many_descriptors_go_to_the_checked_kernel_with_every_region(pair):
    me, peer, driver = pair
    driver.kernel = True
    src, dst, n = _many()
    for _ in range(2):
        result = me._write_device(peer, src, dst, n)
        assert result.ok and result.num_bytes == int(n.sum())
    assert sorted(driver.opened) == [b"h0", b"h1", b"h1"]  # every allocation, once
    assert not driver.copies  # the host-checked copy was not used
    sent, regions, sources, destinations = driver.checked
    assert sent.tolist() == dst.tolist()  # peer addresses: the kernel maps them
    assert (sources, destinations) == (1, 3)
    lo, hi = regions[:1], regions[1:2]
    assert (lo.tolist(), hi.tolist()) == ([0x1000_0000], [0x1000_0000 + (1 << 20)])
    d = regions[2:].reshape(3, 3)  # dst lo, dst hi, delta per region
    assert d[0].tolist() == [0x2000_0000, 0x3000_1000, 0x3001_1000]
    assert d[1].tolist() == [0x2010_0000, 0x3001_1000, 0x3002_1000]
    assert d[2].tolist() == [MAPPED[b"h0"] - 0x2000_0000, MAPPED[b"h1"] - 0x3000_0000,
                             MAPPED[b"h1"] - 0x3000_0000]


@pytest.mark.parametrize("refused,names", [((True, False), "source outside"),
                                           ((False, True), "destination outside"),
                                           ((True, True), "source outside")])
def test_the_kernels_refusal_fails_the_write_by_side(pair, refused, names):
    me, peer, driver = pair
    driver.kernel, driver.refused = True, refused
    result = me._write_device(peer, *_many())
    assert not result.ok and names in result.error


def test_few_descriptors_or_no_kernel_keep_the_host_checks(pair):
    me, peer, driver = pair
    src, dst, n = _many()
    assert me._write_device(peer, src, dst, n).ok  # kernel unavailable
    driver.kernel = True
    assert me._write_device(peer, src[:2], dst[:2], n[:2]).ok  # below BATCH_MIN
    assert len(driver.copies) == 2 and not hasattr(driver, "checked")
    outside = dst.copy()
    outside[3] = 0x2010_0000
    driver.kernel = False
    result = me._write_device(peer, src, outside, n)
    assert not result.ok and "destination outside" in result.error


def test_the_device_checks_switch_keeps_the_host_checks(pair, monkeypatch):
    me, peer, driver = pair
    driver.kernel = True
    monkeypatch.setenv(cuda_ipc.DEVICE_CHECKS_ENV, "0")
    assert me._write_device(peer, *_many()).ok
    assert len(driver.copies) == 1 and not hasattr(driver, "checked")


def test_more_regions_than_the_kernel_holds_keep_the_host_checks(pair, monkeypatch):
    me, peer, driver = pair
    driver.kernel = True
    monkeypatch.setattr(cuda_kernel, "MAX_REGIONS", 2)  # the peer has 3
    assert me._write_device(peer, *_many()).ok
    assert len(driver.copies) == 1 and not hasattr(driver, "checked")


def test_the_region_table_is_laid_out_as_the_kernel_reads_it():
    table = cuda_kernel.region_table(_u64([[1, 2], [3, 4]]), _u64([[10, 20, 7]]))
    assert table.tolist() == [1, 3, 2, 4, 10, 20, 7]
    with pytest.raises(ValueError, match="at most"):
        cuda_kernel.region_table(np.zeros((cuda_kernel.MAX_REGIONS + 1, 2), np.uint64),
                                 np.zeros((1, 3), np.uint64))
