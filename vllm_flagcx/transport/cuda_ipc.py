"""CUDA IPC for the same-host transport: the few CUDA driver calls it needs, via ctypes.

Loaded lazily (``libcuda.so.1``) and only for device pointers, so host-only machines never
touch it. A registered device range is exported once per allocation base
(``cuIpcGetMemHandle``); a peer opens each handle once (``cuIpcOpenMemHandle``) and
translates addresses into its mapping. Few descriptors go as asynchronous device-to-device
memcpys on one stream, many as one batched kernel launch (``cuda_kernel``); both are
synchronised before success is reported.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm_flagcx.transport import cuda_kernel

logger = logging.getLogger(__name__)

CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_MEMORYTYPE_DEVICE = 2
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
IPC_HANDLE_BYTES = 64
BATCH_MIN = 8  # from this many descriptors on, one batched kernel launch
BATCHED_ENV = "VLLM_FLAGCX_CUDA_BATCHED_COPY"  # "0": one memcpy per descriptor
# "0": bounds checks on the host before the batched copy, not in the kernel (an A/B switch
# and an escape hatch; both refuse the same descriptors)
DEVICE_CHECKS_ENV = "VLLM_FLAGCX_CUDA_DEVICE_CHECKS"


class CudaError(RuntimeError):
    pass


class _IpcHandle(ctypes.Structure):
    # c_ubyte, not c_char: a c_char array field reads back cut at its first NUL byte.
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]


class CudaDriver:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._check(self.lib.cuInit(0), "cuInit")
        self._local = threading.local()
        self._opened: dict[bytes, int] = {}
        self._kernels: dict[int, cuda_kernel.BatchedCopy | None] = {}
        self._lock = threading.Lock()

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise CudaError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")

    def _attr(self, attribute: int, ptr: int) -> int | None:
        value = ctypes.c_int(0)
        rc = self.lib.cuPointerGetAttribute(ctypes.byref(value), attribute,
                                            ctypes.c_uint64(ptr))
        return value.value if rc == 0 else None

    def is_device(self, ptr: int) -> bool:
        return self._attr(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr) == CU_MEMORYTYPE_DEVICE

    def device_of(self, ptr: int) -> int:
        ordinal = self._attr(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        if ordinal is None:
            raise CudaError(f"{ptr:#x} is not device memory")
        return ordinal

    def use_device(self, ordinal: int) -> None:
        """Make the device's primary context current in this thread (side-channel threads
        start without one)."""
        if getattr(self._local, "device", None) == ordinal:
            return
        dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
                    "cuDevicePrimaryCtxRetain")
        self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        stream = ctypes.c_void_p()
        self._check(self.lib.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
        self._local.device, self._local.stream = ordinal, stream

    def allocation(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        self._check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                     ctypes.c_uint64(ptr)),
                    "cuMemGetAddressRange")
        return base.value, size.value

    def export(self, base: int) -> bytes:
        handle = _IpcHandle()
        self._check(self.lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(base)),
                    "cuIpcGetMemHandle (VMM/expandable_segments allocations cannot be shared)")
        return bytes(handle.reserved)

    def open(self, handle: bytes, ordinal: int) -> int:
        with self._lock:
            if handle in self._opened:
                return self._opened[handle]
            self.use_device(ordinal)
            raw = _IpcHandle()
            ctypes.memmove(raw.reserved, handle, IPC_HANDLE_BYTES)
            ptr = ctypes.c_uint64(0)
            self._check(self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw,
                                                       CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                        "cuIpcOpenMemHandle")
            self._opened[handle] = ptr.value
            return ptr.value

    def copy_batch(self, ordinal: int, dst: np.ndarray, src: np.ndarray,
                   length: np.ndarray) -> None:
        """Few descriptors: one async memcpy each (the copy engines run a single large copy
        at full rate). From ``BATCH_MIN`` descriptors on: one batched kernel launch."""
        self.use_device(ordinal)
        stream = self._local.stream
        kernel = self._kernel(ordinal) if dst.size >= BATCH_MIN else None
        if kernel is not None:
            kernel.run(stream, dst, src, length)
        else:
            memcpy = self.lib.cuMemcpyDtoDAsync_v2
            for d, s, n in zip(dst.tolist(), src.tolist(), length.tolist(), strict=True):
                rc = memcpy(ctypes.c_uint64(d), ctypes.c_uint64(s), ctypes.c_size_t(n), stream)
                if rc != 0:
                    self._check(rc, "cuMemcpyDtoDAsync")
        self._check(self.lib.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def _kernel(self, ordinal: int) -> cuda_kernel.BatchedCopy | None:
        """The device's batched-copy kernel, built once; None when switched off or NVRTC is
        missing (logged once, then one memcpy per descriptor). The device's context is made
        current first: loading the module needs one, and a side-channel thread has none
        (a build from there failed for good, and every write of that process copied one
        descriptor at a time: measured 9-77 ms for what the kernel moves in ~0.3 ms)."""
        if os.environ.get(BATCHED_ENV, "1") == "0":
            return None
        self.use_device(ordinal)
        with self._lock:
            if ordinal not in self._kernels:
                try:
                    self._kernels[ordinal] = cuda_kernel.BatchedCopy(self.lib, self._check,
                                                                     ordinal)
                except (cuda_kernel.KernelUnavailable, CudaError, OSError) as exc:
                    logger.warning("FlagCX CUDA IPC: batched copy kernel unavailable (%s); "
                                   "copying one descriptor at a time", exc)
                    self._kernels[ordinal] = None
            return self._kernels[ordinal]

    def digest(self, ordinal: int, tiles: np.ndarray, ids: np.ndarray,
               slots: int) -> np.ndarray | None:
        """The full digest's sums in one launch on this thread's stream
        (``BatchedCopy.digest``); None where the kernels are unavailable."""
        kernel = self._kernel(ordinal)
        if kernel is None:
            return None
        return kernel.digest(self._local.stream, tiles, ids, slots)

    def has_kernel(self, ordinal: int) -> bool:
        """The batched kernels are usable on this device (``copy_checked`` can run)."""
        return self._kernel(ordinal) is not None

    def copy_checked(self, ordinal: int, dst: np.ndarray, src: np.ndarray,
                     length: np.ndarray, regions: np.ndarray, sources: int,
                     destinations: int) -> tuple[bool, bool]:
        """Copy to peer addresses ``dst`` with every descriptor checked on the device
        against ``regions`` (``cuda_kernel.region_table``: ``sources`` of this process's
        regions, ``destinations`` of the peer's with their mapping deltas), synchronised.
        The answer: (a source was outside, a destination was outside); a descriptor
        outside was not copied. Why on the device: the host's bounds pass over 20,910
        descriptors cost ~90 us of numpy per write, more than half the copy's ~130 us on an
        H100; the kernel checks each descriptor against its regions for free."""
        kernel = self._kernel(ordinal)
        if kernel is None:
            raise CudaError("copy_checked needs the batched kernel (ask has_kernel first)")
        stream = self._local.stream
        refused = kernel.run_checked(stream, dst, src, length, regions, sources, destinations)
        self._check(self.lib.cuStreamSynchronize(stream), "cuStreamSynchronize")
        return (bool(refused[cuda_kernel.SOURCE_OUTSIDE]),
                bool(refused[cuda_kernel.DESTINATION_OUTSIDE]))

    def fill(self, address: int, byte: int, size: int) -> None:
        """Set ``size`` bytes of device memory at ``address`` to ``byte`` (synchronous;
        the decode-side test faults write garbage into received GPU blocks with it)."""
        self.use_device(self.device_of(address))
        self._check(self.lib.cuMemsetD8_v2(ctypes.c_uint64(address), ctypes.c_ubyte(byte),
                                           ctypes.c_size_t(size)), "cuMemsetD8")

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of several small device ranges, on this thread's own non-blocking
        stream with one synchronisation: from ``BATCH_MIN`` ranges on, one gather launch
        (``BatchedCopy.gather``), else one async copy per range. One synchronous copy per
        range waited on the legacy default stream each time (and on whatever the engine had
        queued there): B2d on an H100 measured 13 ms for a 16-range sample behind a busy
        default stream, 0.16 ms on a stream of its own."""
        if not ranges:
            return []
        ordinal = self.device_of(ranges[0][0])
        self.use_device(ordinal)
        stream = self._local.stream
        kernel = self._kernel(ordinal) if len(ranges) >= BATCH_MIN else None
        if kernel is not None:
            raw = kernel.gather(stream, np.array([a for a, _ in ranges], dtype=np.uint64),
                                np.array([n for _, n in ranges], dtype=np.uint64))
        else:
            out = ctypes.create_string_buffer(sum(size for _, size in ranges))
            base, offset = ctypes.addressof(out), 0
            for address, size in ranges:
                self._check(self.lib.cuMemcpyDtoHAsync_v2(
                    ctypes.c_void_p(base + offset), ctypes.c_uint64(address),
                    ctypes.c_size_t(size), stream), "cuMemcpyDtoHAsync (integrity sample)")
                offset += size
            self._check(self.lib.cuStreamSynchronize(stream), "cuStreamSynchronize")
            raw = out.raw
        pieces, offset = [], 0
        for _, size in ranges:
            pieces.append(raw[offset:offset + size])
            offset += size
        return pieces


@functools.lru_cache(maxsize=1)
def driver() -> CudaDriver | None:
    """The CUDA driver, or None on machines without one (host memory only)."""
    try:
        return CudaDriver()
    except (OSError, CudaError, AttributeError):
        return None


def describe_device(ptr: int, size: int) -> list[dict[str, Any]] | None:
    """Export facts for a registered device range, one entry per CUDA allocation it covers,
    or None for host memory.

    An IPC handle maps ONE allocation. A registered range may span several: vLLM allocates
    each KV cache tensor on its own, the caching allocator often places them back to back,
    and the connector registers adjacent storages as one span. Exporting only the first
    allocation's handle made every address past its end invalid in the peer (measured on
    the H200: CUDA_ERROR_INVALID_VALUE from the copy, or an illegal address in the batched
    kernel that took the prefill engine down), so the range is cut at allocation ends."""
    cuda = driver()
    if cuda is None or not cuda.is_device(ptr):
        return None
    pieces = []
    start, end = ptr, ptr + size
    while start < end:
        base, length = cuda.allocation(start)
        stop = min(end, base + length)
        if stop <= start:
            raise CudaError(f"{start:#x} lies in no allocation of {length} bytes at {base:#x}")
        pieces.append({"addr": start, "size": stop - start, "base": base,
                       "handle": cuda.export(base), "device": cuda.device_of(start)})
        start = stop
    return pieces
