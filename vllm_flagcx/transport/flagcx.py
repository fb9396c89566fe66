"""FlagCX's P2P engine through the project's own minimal ctypes binding.

Only the C ABI facade is bound (``flagcxP2pRpc*`` plus ``flagcxGetVersion`` and
``flagcxGetErrorString``); no FlagCX source tree goes on ``sys.path`` and vLLM's collective
backend is never touched. The library loads lazily, from the first of: the explicit
setting (``kv_connector_extra_config.flagcx_library``), ``FLAGCX_LIB_PATH``,
``$FLAGCX_PATH/build/lib/libflagcx.so``.

What the real library does, and what this binding does about it (read and built from the
FlagCX sources, v0.13.0 .. main):
- Capability is read by symbol: every symbol the binding calls is required;
  ``flagcxP2pRpcRegisterHost`` (in no release yet) is optional and used for host caches.
  ``flagcxGetVersion`` reports 10000 ("1.0.0") in every release, so it is shown, never
  gated on.
- Every facade failure returns -1 and ``flagcxGetErrorString`` says "Not implemented." for
  every code: errors here name the call, the peer and the sizes instead.
- With libibverbs present and no RDMA device, ``EngineCreate`` succeeds and the first
  ``Register`` segfaults (NULL protection domain), and ``StartServer`` busy-spins: the
  transport checks for an RDMA device (the kernel's InfiniBand class) before it creates
  the engine, and refuses with the fix. ``GetConn`` to a dead peer blocks ~25 s: bounded by
  our own timeout.
- Sizes are cast to 32 bits inside the engine (descriptors above 4 GiB are split here);
  ``BatchWriteSync`` can return 0 when RDMA slices failed (decode's integrity check turns
  that into a failed request).
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_flagcx.transport.base import Transport, TransportError, WriteResult

MAX_DESCRIPTOR_BYTES = (1 << 32) - 4096  # the engine stores sizes in uint32
RDMA_SYSFS = Path("/sys/class/infiniband")  # one entry per RDMA device the kernel knows
FACADE_FAILED = -1  # what every flagcxP2pRpc* facade call returns on any failure

_u64 = ctypes.c_uint64
_p = ctypes.c_void_p
SYMBOLS: dict[str, tuple[object, list[object]]] = {
    "flagcxGetVersion": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]),
    "flagcxGetErrorString": (ctypes.c_char_p, [ctypes.c_int]),
    "flagcxP2pRpcEngineCreate": (_p, []),
    "flagcxP2pRpcEngineDestroy": (None, [_p]),
    "flagcxP2pRpcGetPort": (ctypes.c_int, [_p]),
    "flagcxP2pRpcStartServer": (ctypes.c_int, [_p]),
    "flagcxP2pRpcRegister": (ctypes.c_int, [_p, _u64, _u64, ctypes.POINTER(_u64)]),
    "flagcxP2pRpcGetConn": (_p, [_p, ctypes.c_char_p]),
    "flagcxP2pRpcBatchWriteSync": (ctypes.c_int, [_p, ctypes.c_int, ctypes.POINTER(_u64),
                                                  ctypes.POINTER(_u64), ctypes.POINTER(_u64)]),
}
# Used where present (absent from every release so far): registration of host memory.
OPTIONAL_SYMBOLS: dict[str, tuple[object, list[object]]] = {
    "flagcxP2pRpcRegisterHost": (ctypes.c_int, [_p, _u64, _u64, ctypes.POINTER(_u64)]),
}


class FlagCXLoadError(TransportError):
    """libflagcx cannot be used: not configured, not loadable, missing a symbol, or no RDMA
    device for its P2P engine."""


def version_string(code: int) -> str:
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def rdma_devices(sysfs: Path = RDMA_SYSFS) -> list[str]:
    """RDMA devices the kernel knows (``/sys/class/infiniband``): mlx5_0, rxe0, ..."""
    try:
        return sorted(entry.name for entry in sysfs.iterdir())
    except OSError:
        return []


def require_rdma_device(sysfs: Path = RDMA_SYSFS) -> list[str]:
    """The RDMA devices, or FlagCXLoadError naming the fix (FlagCX's engine would be created
    without one, and its first registration would segfault the worker)."""
    devices = rdma_devices(sysfs)
    if not devices:
        raise FlagCXLoadError(
            f"no RDMA device ({sysfs} is empty or absent): FlagCX's P2P engine moves KV "
            "over RDMA only (with libibverbs and no device its first registration crashes "
            "the process). Fix: for prefill and decode on one host use "
            "kv_connector_extra_config.transport='local'; across hosts, give each node an "
            "RDMA NIC (InfiniBand or RoCE) and its driver")
    return devices


def library_path(configured: str | None = None) -> Path:
    """Where libflagcx.so is, from the explicit setting, then the environment."""
    if configured:
        return Path(configured)
    if os.environ.get("FLAGCX_LIB_PATH"):
        return Path(os.environ["FLAGCX_LIB_PATH"])
    if os.environ.get("FLAGCX_PATH"):
        return Path(os.environ["FLAGCX_PATH"]) / "build" / "lib" / "libflagcx.so"
    raise FlagCXLoadError(
        "no libflagcx configured: set kv_connector_extra_config.flagcx_library, or "
        "FLAGCX_LIB_PATH, or FLAGCX_PATH (its build/lib/libflagcx.so); or use "
        "transport='local' for prefill and decode on one host")


class FlagCXLibrary:
    """The loaded library with every symbol typed; raises ``FlagCXLoadError`` otherwise."""

    def __init__(self, path: Path) -> None:
        try:
            self.lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise FlagCXLoadError(f"cannot load libflagcx from {path}: {exc}") from exc
        self.version = self._read_version(path)
        missing = [name for name in SYMBOLS if not hasattr(self.lib, name)]
        if missing:
            raise FlagCXLoadError(
                f"{path} ({self.version}) lacks {missing[0]}"
                f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}: this "
                "binding calls the flagcxP2pRpc* C facade (flagcx/include/flagcx_p2p.h) of "
                "FlagCX v0.13.0 or newer; build one of those")
        self.optional = {name for name in OPTIONAL_SYMBOLS if hasattr(self.lib, name)}
        for name, (restype, argtypes) in {**SYMBOLS, **OPTIONAL_SYMBOLS}.items():
            if name in SYMBOLS or name in self.optional:
                fn = getattr(self.lib, name)
                fn.restype, fn.argtypes = restype, argtypes

    def _read_version(self, path: Path) -> str:
        """What ``flagcxGetVersion`` says, shown as it is: every release so far reports
        10000 ("1.0.0"), so it identifies nothing and gates nothing."""
        get_version = getattr(self.lib, "flagcxGetVersion", None)
        if get_version is None:
            raise FlagCXLoadError(f"{path} lacks flagcxGetVersion: not a FlagCX library")
        code = ctypes.c_int(0)
        get_version.argtypes = [ctypes.POINTER(ctypes.c_int)]
        get_version.restype = ctypes.c_int
        if get_version(ctypes.byref(code)) != 0:
            return "flagcxGetVersion failed"
        return f"flagcxGetVersion {code.value} ({version_string(code.value)})"

    def error(self, code: int) -> str:
        """``code`` in words: FlagCX's facade returns -1 for every failure and its error
        string is "Not implemented." for every code, so both are only quoted."""
        text = (self.lib.flagcxGetErrorString(code) or b"").decode(errors="replace")
        meaning = "failed" if code == FACADE_FAILED else f"flagcxResult {code}"
        return f"{meaning} (returned {code}; FlagCX's error string: {text!r})"


def split_large(src: np.ndarray, dst: np.ndarray, length: np.ndarray,
                limit: int = MAX_DESCRIPTOR_BYTES) -> tuple[np.ndarray, ...]:
    """Split descriptors longer than ``limit`` into pieces the engine's uint32 can hold."""
    length = length.astype(np.uint64)
    pieces = np.maximum(1, (length + limit - 1) // limit).astype(np.int64)
    if (pieces == 1).all():
        return src.astype(np.uint64), dst.astype(np.uint64), length
    idx = np.repeat(np.arange(src.size), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    k = (np.arange(idx.size) - first).astype(np.uint64)
    offset = k * np.uint64(limit)
    out_len = np.minimum(length[idx] - offset, np.uint64(limit))
    return (src.astype(np.uint64)[idx] + offset, dst.astype(np.uint64)[idx] + offset, out_len)


@dataclass(frozen=True)
class _Conn:
    handle: int
    session: str


def _ptr(a: np.ndarray) -> object:
    return a.ctypes.data_as(ctypes.POINTER(_u64))


class FlagCXTransport(Transport):
    """One P2P engine per worker; writes are one-sided into the peer's registered memory.

    ``rdma_sysfs``: where to look for RDMA devices before the engine is created (None: do
    not look; only for a stand-in library that needs none). ``host_memory``: the KV caches
    are host memory (registered with ``RegisterHost`` where the library has it).
    ``connect_timeout``: bound on ``GetConn``, which blocks ~25 s on a dead peer.
    """

    name = "flagcx"

    def __init__(self, library: FlagCXLibrary, advertise_host: str = "127.0.0.1", *,
                 rdma_sysfs: Path | None = RDMA_SYSFS, host_memory: bool = False,
                 connect_timeout: float = 10.0) -> None:
        self.library = library
        self.host = advertise_host
        self.host_memory = host_memory
        self.connect_timeout = connect_timeout
        self.engine = None
        if rdma_sysfs is not None:
            require_rdma_device(rdma_sysfs)
        self.engine = library.lib.flagcxP2pRpcEngineCreate()
        if not self.engine:
            raise TransportError("flagcxP2pRpcEngineCreate returned NULL (FlagCX could not "
                                 "open an RDMA device or the accelerator runtime); run with "
                                 "FLAGCX_DEBUG=INFO for its reason")
        self._serving = False

    def register(self, address: int, size: int) -> None:
        mr = _u64(0)
        host = self.host_memory and "flagcxP2pRpcRegisterHost" in self.library.optional
        call = "flagcxP2pRpcRegisterHost" if host else "flagcxP2pRpcRegister"
        rc = getattr(self.library.lib, call)(self.engine, address, size, ctypes.byref(mr))
        if rc != 0:
            raise TransportError(f"{call}(address {address:#x}, {size} bytes, "
                                 f"{'host' if self.host_memory else 'device'} memory) "
                                 f"{self.library.error(rc)}")

    def describe(self) -> bytes:
        # Peers connect after the handshake, so every region is registered by now: the
        # engine sends its region table to each peer when it accepts the connection.
        if not self._serving:
            rc = self.library.lib.flagcxP2pRpcStartServer(self.engine)
            if rc != 0:
                raise TransportError(f"flagcxP2pRpcStartServer {self.library.error(rc)}")
            self._serving = True
        return f"{self.host}:{self.library.lib.flagcxP2pRpcGetPort(self.engine)}".encode()

    def connect(self, peer: bytes) -> _Conn:
        """``GetConn`` in a helper thread, bounded by ``connect_timeout`` (the engine blocks
        ~25 s on a dead peer; a late answer is abandoned, the caller fails now)."""
        session = peer.decode(errors="replace")
        result: list[int | None] = []
        worker = threading.Thread(
            target=lambda: result.append(self.library.lib.flagcxP2pRpcGetConn(self.engine,
                                                                              peer)),
            name="flagcx-getconn", daemon=True)
        worker.start()
        worker.join(self.connect_timeout)
        if worker.is_alive():
            raise TransportError(f"flagcxP2pRpcGetConn to {session!r} did not answer within "
                                 f"{self.connect_timeout:.0f} s (peer down or unreachable)")
        if not result or not result[0]:
            raise TransportError(f"flagcxP2pRpcGetConn to {session!r} returned NULL (peer "
                                 "refused or unreachable; FLAGCX_DEBUG=INFO says why)")
        return _Conn(result[0], session)

    def write(self, handle: object, src: np.ndarray, dst: np.ndarray, length: np.ndarray,
              src_hint: np.ndarray | None = None,
              dst_hint: np.ndarray | None = None) -> WriteResult:
        """FlagCX checks the remote side itself; the span hints are not used here."""
        conn: _Conn = handle  # type: ignore[assignment]
        src, dst, length = (np.ascontiguousarray(a) for a in split_large(src, dst, length))
        if src.size == 0:
            return WriteResult(True)
        rc = self.library.lib.flagcxP2pRpcBatchWriteSync(conn.handle, int(src.size), _ptr(src),
                                                         _ptr(dst), _ptr(length))
        if rc != 0:
            return WriteResult(False, f"flagcxP2pRpcBatchWriteSync to {conn.session} "
                                      f"({int(src.size)} descriptors, {int(length.sum())} "
                                      f"bytes) {self.library.error(rc)}")
        return WriteResult(True, "", int(length.sum()))

    def close(self) -> None:
        if self.engine:
            self.library.lib.flagcxP2pRpcEngineDestroy(self.engine)
            self.engine = None


_LOADED: dict[Path, FlagCXLibrary] = {}
_LOAD_LOCK = threading.Lock()


def load_library(path: Path) -> FlagCXLibrary:
    """The library at ``path``, loaded and checked once per process: choosing a transport
    (``transport: auto`` probes it) and creating one share the same load. A failed load is
    not remembered, so a fixed path works on the next call."""
    key = Path(path).resolve()
    with _LOAD_LOCK:
        if key not in _LOADED:
            _LOADED[key] = FlagCXLibrary(key)
        return _LOADED[key]


def open_transport(configured_library: str | None, host: str, rdma_check: bool,
                   host_memory: bool, connect_timeout: float) -> FlagCXTransport:
    """The FlagCX transport (``transport: flagcx``), from the connector's checked settings
    (``connector.settings``: the only reader of ``kv_connector_extra_config``, so a value
    means the same to choosing a transport and to opening it); loads the library now."""
    return FlagCXTransport(load_library(library_path(configured_library)), host,
                           rdma_sysfs=RDMA_SYSFS if rdma_check else None,
                           host_memory=host_memory, connect_timeout=connect_timeout)
