"""STAND-IN transport for tests: really copies bytes between CPU tensors (memmove).

It implements the package's ``Transport`` interface within one process (P and D workers
of a test live in the same process), standing in for FlagCX's RDMA engine, which cannot
exist on a machine without an RDMA NIC and libflagcx. Every write is checked against the
peer's registered ranges, as a NIC would. Fault knobs make it fail on purpose.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from dataclasses import dataclass

import numpy as np

from vllm_flagcx.layout.bounds import RangeTable
from vllm_flagcx.transport.base import Transport, TransportError, WriteResult

_ENDPOINTS: dict[bytes, MemmoveTransport] = {}
_ids = itertools.count()
_lock = threading.Lock()


@dataclass
class Faults:
    fail_register: bool = False
    fail_connect: bool = False
    fail_write_from: int | None = None  # the N-th write (0-based) and later fail
    fail_write_at: frozenset[int] = frozenset()  # only these writes fail
    silent_skip_from: int | None = None  # report success but copy nothing (RDMA slice loss)
    delay_seconds: float = 0.0


class MemmoveTransport(Transport):
    """Stand-in: one endpoint per worker; ``write`` memmoves into the peer's memory."""

    name = "memmove-standin"
    max_concurrent_writes = 4

    def __init__(self, faults: Faults | None = None) -> None:
        self.faults = faults or Faults()
        self.ranges: list[tuple[int, int]] = []
        self.writes = 0
        self.connects = 0
        self.write_done_at: list[float] = []  # time.monotonic() of each completed copy
        self.write_first_dst: list[int] = []  # the first destination address of each
        self._desc = f"memmove:{next(_ids)}".encode()
        with _lock:
            _ENDPOINTS[self._desc] = self

    def register(self, address: int, size: int) -> None:
        if self.faults.fail_register:
            raise TransportError(f"register({address:#x}, {size}) refused (fault knob)")
        self.ranges.append((address, address + size))

    def describe(self) -> bytes:
        return self._desc

    def connect(self, peer: bytes) -> MemmoveTransport:
        if self.faults.fail_connect:
            raise TransportError(f"connect to {peer!r} refused (fault knob)")
        self.connects += 1
        with _lock:
            endpoint = _ENDPOINTS.get(peer)
        if endpoint is None:
            raise TransportError(f"no endpoint {peer!r}")
        return endpoint

    def write(self, handle: object, src: np.ndarray, dst: np.ndarray, length: np.ndarray,
              src_hint: np.ndarray | None = None,
              dst_hint: np.ndarray | None = None) -> WriteResult:
        with _lock:
            index, self.writes = self.writes, self.writes + 1
        if self.faults.delay_seconds:
            time.sleep(self.faults.delay_seconds)
        f = self.faults
        if (f.fail_write_from is not None and index >= f.fail_write_from) or \
                index in f.fail_write_at:
            return WriteResult(False, f"write {index} failed (fault knob)")
        peer: MemmoveTransport = handle  # type: ignore[assignment]
        src, dst, length = (a.astype(np.int64) for a in (src, dst, length))
        if not RangeTable(self.ranges).holds(src, length):
            return WriteResult(False, "source outside registered memory")
        if not RangeTable(peer.ranges).holds(dst, length):
            return WriteResult(False, "destination outside the peer's registered memory")
        if f.silent_skip_from is not None and index >= f.silent_skip_from:
            return WriteResult(True, "", int(length.sum()))  # the lie FlagCX can tell
        for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
            ctypes.memmove(d, s, n)
        self.write_done_at.append(time.monotonic())
        self.write_first_dst.append(int(dst[0]) if dst.size else 0)
        return WriteResult(True, "", int(length.sum()))

    def close(self) -> None:
        with _lock:
            _ENDPOINTS.pop(self._desc, None)


FAULTS_KEY = "standin_faults"  # kv_connector_extra_config key: Faults fields for ``factory``


def factory(vllm_config: object, tp_rank: int) -> MemmoveTransport:
    """``transport_factory`` entry for kv_connector_extra_config (stand-in, see above).

    A connector built through vLLM's own entry (``FlagCXConnector``) makes its transport
    here, so its fault knobs come through the config: ``standin_faults`` holds
    ``Faults`` fields (without it, no faults)."""
    extra = getattr(getattr(vllm_config, "kv_transfer_config", None),
                    "kv_connector_extra_config", None) or {}
    return MemmoveTransport(Faults(**extra.get(FAULTS_KEY, {})))


def not_a_transport(vllm_config: object, tp_rank: int) -> object:
    """A ``transport_factory`` that returns something else (a configuration error)."""
    return object()
