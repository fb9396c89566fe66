"""Same-host transport: host memory by ``process_vm_writev``, GPU memory by CUDA IPC.

The embedded default (a laptop, a CI machine, a single-node PD on one box). Host memory:
one syscall per batch of up to IOV_MAX descriptors, no copy through a socket; the kernel
checks permissions like ptrace does, and a refusal names the setting to change. Device
memory (CUDA, and CUDA-alike vendor builds exposing the same driver API): each registered
range is exported by CUDA IPC once, opened once per peer, and written by device copies
synchronised before success is reported (``transport.cuda_ipc``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
from dataclasses import dataclass, field

import msgspec
import numpy as np

from vllm_flagcx.layout.bounds import OUTSIDE, RangeTable
from vllm_flagcx.transport import cuda_ipc, cuda_kernel
from vllm_flagcx.transport.base import Transport, TransportError, WriteResult

IOV_MAX = 1024
_SOURCE_OUTSIDE = "source outside this process's registered GPU memory"


def _destination_outside(pid: int) -> str:
    return f"destination outside the GPU memory pid {pid} registered"


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _DeviceRange(msgspec.Struct, frozen=True, array_like=True):
    addr: int
    size: int
    base: int  # the allocation's base address (what the IPC handle maps)
    handle: bytes
    device: int


class _Description(msgspec.Struct, frozen=True):
    host_id: str
    pid: int
    ranges: tuple[tuple[int, int], ...]
    device_ranges: tuple[_DeviceRange, ...] = ()


def host_id() -> str:
    """This machine's identity: the kernel boot id (same host <=> same boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return socket.gethostname()


def _device_table(ranges: tuple[_DeviceRange, ...] | list[_DeviceRange]) -> RangeTable:
    return RangeTable((r.addr, r.addr + r.size) for r in ranges)


@dataclass(eq=False)  # compared and hashed by identity, as a connection handle
class _Peer:
    """A connected peer: its ranges as lookup tables, and per device range what to add to
    a peer address to get this process's IPC mapping of it (mod 2**64), filled in when
    that range's handle is first opened."""

    pid: int
    ranges: tuple[tuple[int, int], ...]
    device_ranges: tuple[_DeviceRange, ...] = ()
    table: RangeTable = field(init=False)
    device_table: RangeTable = field(init=False)
    deltas: np.ndarray = field(init=False)
    opened: np.ndarray = field(init=False)
    # the checked kernel's region table, with the local device table it was built from
    kernel_regions: tuple[RangeTable, np.ndarray] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.table = RangeTable(self.ranges)
        self.device_table = _device_table(self.device_ranges)
        self.deltas = np.zeros(len(self.device_ranges), np.uint64)
        self.opened = np.zeros(len(self.device_ranges), bool)


class LocalTransport(Transport):
    """Writes host memory of another process on the same machine."""

    name = "local"

    @property
    def max_concurrent_writes(self) -> int:  # type: ignore[override]
        """process_vm_writev is thread-safe; device copies go through one CUDA context
        and stay serial."""
        return 1 if self.device_ranges else 4

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        if not hasattr(self._libc, "process_vm_writev"):
            raise TransportError("the local transport needs process_vm_writev (Linux >= 3.2)")
        self._libc.process_vm_writev.restype = ctypes.c_ssize_t
        self._libc.process_vm_writev.argtypes = [
            ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
            ctypes.c_ulong, ctypes.c_ulong]
        self.ranges: list[tuple[int, int]] = []
        self.device_ranges: list[_DeviceRange] = []
        # lookup tables of the two lists, rebuilt by register (not per write)
        self._table, self._device_table = RangeTable(()), RangeTable(())

    def register(self, address: int, size: int) -> None:
        if address <= 0 or size <= 0:
            raise TransportError(f"register({address:#x}, {size}): address and size must be > 0")
        try:
            device = cuda_ipc.describe_device(address, size)
        except cuda_ipc.CudaError as exc:
            raise TransportError(f"register({address:#x}, {size}): {exc}") from exc
        if device is not None:
            self.device_ranges += [_DeviceRange(**piece) for piece in device]
            self._device_table = _device_table(self.device_ranges)
        else:
            self.ranges.append((address, address + size))
            self._table = RangeTable(self.ranges)

    def describe(self) -> bytes:
        return msgspec.msgpack.encode(_Description(host_id(), os.getpid(), tuple(self.ranges),
                                                   tuple(self.device_ranges)))

    def peer_pid(self, peer: bytes) -> int | None:
        try:
            return int(msgspec.msgpack.decode(peer, type=_Description).pid)
        except msgspec.DecodeError:
            return None

    def connect(self, peer: bytes) -> _Peer:
        try:
            desc = msgspec.msgpack.decode(peer, type=_Description)
        except msgspec.DecodeError as exc:
            raise TransportError(f"not a local-transport description: {exc}") from exc
        if desc.host_id != host_id():
            raise TransportError(
                "the local transport only reaches processes on this host, and the peer runs "
                "on another one; set kv_connector_extra_config.transport='flagcx' for "
                "prefill and decode on different machines")
        return _Peer(desc.pid, desc.ranges, desc.device_ranges)

    def write(self, handle: object, src: np.ndarray, dst: np.ndarray, length: np.ndarray,
              src_hint: np.ndarray | None = None,
              dst_hint: np.ndarray | None = None) -> WriteResult:
        peer: _Peer = handle  # type: ignore[assignment]
        src, dst, length = (np.asarray(a, dtype=np.uint64) for a in (src, dst, length))
        if src.size == 0:
            return WriteResult(True)
        if peer.device_ranges and self.device_ranges:
            return self._write_device(peer, src, dst, length, src_hint, dst_hint)
        if not self._table.holds(src, length, src_hint):
            return WriteResult(False, "source outside this process's registered memory")
        if not peer.table.holds(dst, length, dst_hint):
            return WriteResult(False, f"destination outside the memory pid {peer.pid} "
                                      "registered")
        total = 0
        for start in range(0, src.size, IOV_MAX):
            result = self._write_chunk(peer.pid, src[start:start + IOV_MAX],
                                       dst[start:start + IOV_MAX],
                                       length[start:start + IOV_MAX])
            if not result.ok:
                return result
            total += result.num_bytes
        return WriteResult(True, "", total)

    def _write_device(self, peer: _Peer, src: np.ndarray, dst: np.ndarray,
                      length: np.ndarray, src_hint: np.ndarray | None = None,
                      dst_hint: np.ndarray | None = None) -> WriteResult:
        """Device-to-device copies into the peer's IPC-mapped memory."""
        cuda = cuda_ipc.driver()
        if cuda is None:
            return WriteResult(False, "device memory registered, but no CUDA driver loads "
                                      "in this process")
        if self._checks_on_device(cuda, peer, src.size):
            return self._write_checked(cuda, peer, src, dst, length)
        if not self._device_table.holds(src, length, src_hint):
            return WriteResult(False, _SOURCE_OUTSIDE)
        # an int: one allocation holds all; else the plan's span hints where right
        where = peer.device_table.locate(dst, length, dst_hint)
        if not isinstance(where, int) and np.any(where == OUTSIDE):
            return WriteResult(False, _destination_outside(peer.pid))
        try:
            if not peer.opened.all():  # open each range this batch writes, once per peer
                self._open(cuda, peer, np.bincount(np.atleast_1d(where),
                                                   minlength=len(peer.opened)) > 0)
            # wraps mod 2**64: peer address - allocation base + this process's mapping
            mapped = dst + peer.deltas[where]
            cuda.copy_batch(self.device_ranges[0].device, mapped, src, length)
        except cuda_ipc.CudaError as exc:
            return WriteResult(False, f"CUDA IPC write into pid {peer.pid} failed: {exc}")
        return WriteResult(True, "", int(length.sum()))

    def _checks_on_device(self, cuda: cuda_ipc.CudaDriver, peer: _Peer, n: int) -> bool:
        """Many descriptors, regions the kernel can hold, and the kernel built: the
        bounds checks run in the copy kernel (``_write_checked``), not on the host."""
        return (n >= cuda_ipc.BATCH_MIN
                and os.environ.get(cuda_ipc.DEVICE_CHECKS_ENV, "1") != "0"
                and len(self.device_ranges) <= cuda_kernel.MAX_REGIONS
                and len(peer.device_ranges) <= cuda_kernel.MAX_REGIONS
                and cuda.has_kernel(self.device_ranges[0].device))

    def _write_checked(self, cuda: cuda_ipc.CudaDriver, peer: _Peer, src: np.ndarray,
                       dst: np.ndarray, length: np.ndarray) -> WriteResult:
        """One checked kernel launch: each descriptor's source is checked against this
        process's registered regions and its destination against the peer's, on the
        device, before it is copied; no host pass over the descriptors. Every peer
        allocation is opened first (once per peer), so the kernel can map any of them."""
        try:
            if not peer.opened.all():
                self._open(cuda, peer, np.ones(len(peer.opened), bool))
            regions = self._regions_for(peer)
            source_out, destination_out = cuda.copy_checked(
                self.device_ranges[0].device, dst, src, length, regions,
                len(self.device_ranges), len(peer.device_ranges))
        except cuda_ipc.CudaError as exc:
            return WriteResult(False, f"CUDA IPC write into pid {peer.pid} failed: {exc}")
        if source_out:
            return WriteResult(False, _SOURCE_OUTSIDE)
        if destination_out:
            return WriteResult(False, _destination_outside(peer.pid))
        return WriteResult(True, "", int(length.sum()))

    def _regions_for(self, peer: _Peer) -> np.ndarray:
        """The checked kernel's region table for writes to ``peer`` (built once per peer
        and per set of local registrations)."""
        if peer.kernel_regions is None or peer.kernel_regions[0] is not self._device_table:
            sources = [(r.addr, r.addr + r.size) for r in self.device_ranges]
            destinations = [(r.addr, r.addr + r.size, int(delta))
                            for r, delta in zip(peer.device_ranges, peer.deltas, strict=True)]
            peer.kernel_regions = (self._device_table,
                                   cuda_kernel.region_table(np.array(sources, np.uint64),
                                                            np.array(destinations, np.uint64)))
        return peer.kernel_regions[1]

    def _open(self, cuda: cuda_ipc.CudaDriver, peer: _Peer, needed: np.ndarray) -> None:
        """Open each peer allocation in ``needed`` not opened yet (once per peer), and
        note what to add to its peer addresses to reach this process's mapping."""
        for k in np.flatnonzero(needed & ~peer.opened):
            r = peer.device_ranges[k]
            local = cuda.open(r.handle, self.device_ranges[0].device)
            peer.deltas[k] = np.uint64((local - r.base) % (1 << 64))
            peer.opened[k] = True

    def _write_chunk(self, pid: int, src: np.ndarray, dst: np.ndarray,
                     length: np.ndarray) -> WriteResult:
        n = src.size
        local = (_IoVec * n)()
        remote = (_IoVec * n)()
        # iovec is (pointer, size): fill both arrays from numpy without a Python loop.
        local_view = np.frombuffer(memoryview(local).cast("B"), dtype=np.uint64).reshape(n, 2)
        remote_view = np.frombuffer(memoryview(remote).cast("B"), dtype=np.uint64).reshape(n, 2)
        local_view[:, 0], local_view[:, 1] = src, length
        remote_view[:, 0], remote_view[:, 1] = dst, length
        expected = int(length.sum())
        written = self._libc.process_vm_writev(pid, local, n, remote, n, 0)
        if written < 0:
            err = ctypes.get_errno()
            if err == errno.EPERM:
                return WriteResult(False, (
                    f"process_vm_writev into pid {pid} refused (EPERM): run prefill and "
                    "decode as the same user, and allow ptrace between them (kernel.yama."
                    "ptrace_scope=0, or CAP_SYS_PTRACE, or --cap-add SYS_PTRACE in a "
                    "container)"))
            return WriteResult(False, f"process_vm_writev into pid {pid} failed: "
                                      f"{os.strerror(err)}")
        if written != expected:
            return WriteResult(False, f"process_vm_writev wrote {written} of {expected} bytes "
                                      f"into pid {pid}")
        return WriteResult(True, "", written)
