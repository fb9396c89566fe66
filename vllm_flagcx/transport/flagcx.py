"""FlagCX's P2P engine through the project's own minimal ctypes binding.

Only the C ABI facade is bound (``flagcxP2pRpc*`` plus ``flagcxGetVersion`` and
``flagcxGetErrorString``); no FlagCX source tree goes on ``sys.path`` and vLLM's collective
backend is never touched. The library loads lazily, from the first of: the explicit
setting (``kv_connector_extra_config.flagcx_library``), ``FLAGCX_LIB_PATH``,
``$FLAGCX_PATH/build/lib/libflagcx.so``. Every symbol and the library version are probed at
load; a failure names the missing symbol, the version found and the version needed.

Known engine flaws handled here: sizes are cast to 32 bits inside the engine, so descriptors
above 4 GiB are split; it busy-waits in ``BatchWriteSync`` (one write per call site).
It can report success when RDMA slices failed: that needs an end-to-end integrity check,
which is not in this module yet.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_flagcx.transport.base import Transport, TransportError, WriteResult

MIN_VERSION = 1300  # 0.13.0, the first release with the RPC C ABI (NCCL-style encoding)
MAX_DESCRIPTOR_BYTES = (1 << 32) - 4096  # the engine stores sizes in uint32

_u64 = ctypes.c_uint64
_p = ctypes.c_void_p
SYMBOLS: dict[str, tuple[Any, list[Any]]] = {
    "flagcxGetVersion": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]),
    "flagcxGetErrorString": (ctypes.c_char_p, [ctypes.c_int]),
    "flagcxP2pRpcEngineCreate": (_p, []),
    "flagcxP2pRpcEngineDestroy": (None, [_p]),
    "flagcxP2pRpcGetPort": (ctypes.c_int, [_p]),
    "flagcxP2pRpcStartServer": (ctypes.c_int, [_p]),
    "flagcxP2pRpcRegister": (ctypes.c_int, [_p, _u64, _u64, ctypes.POINTER(_u64)]),
    "flagcxP2pRpcRegisterHost": (ctypes.c_int, [_p, _u64, _u64, ctypes.POINTER(_u64)]),
    "flagcxP2pRpcGetConn": (_p, [_p, ctypes.c_char_p]),
    "flagcxP2pRpcBatchWriteSync": (ctypes.c_int, [_p, ctypes.c_int, ctypes.POINTER(_u64),
                                                  ctypes.POINTER(_u64), ctypes.POINTER(_u64)]),
}


class FlagCXLoadError(TransportError):
    """libflagcx cannot be used: not configured, not loadable, missing a symbol, too old."""


def version_string(code: int) -> str:
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


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
                f"{path} (FlagCX {self.version}) lacks {missing[0]}"
                f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}; FlagCX >= "
                f"{version_string(MIN_VERSION)} built with its P2P engine (USE_IBUC=1) is needed")
        for name, (restype, argtypes) in SYMBOLS.items():
            fn = getattr(self.lib, name)
            fn.restype, fn.argtypes = restype, argtypes

    def _read_version(self, path: Path) -> str:
        get_version = getattr(self.lib, "flagcxGetVersion", None)
        if get_version is None:
            raise FlagCXLoadError(f"{path} lacks flagcxGetVersion: not a FlagCX library, "
                                  f"FlagCX >= {version_string(MIN_VERSION)} is needed")
        code = ctypes.c_int(0)
        get_version.argtypes = [ctypes.POINTER(ctypes.c_int)]
        if get_version(ctypes.byref(code)) != 0 or code.value < MIN_VERSION:
            raise FlagCXLoadError(
                f"{path} is FlagCX {version_string(code.value)}; "
                f"{version_string(MIN_VERSION)} or newer is needed")
        return version_string(code.value)

    def error(self, code: int) -> str:
        text = self.lib.flagcxGetErrorString(code)
        return f"{(text or b'').decode(errors='replace')} (flagcxResult {code})"


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


def _ptr(a: np.ndarray) -> Any:
    return a.ctypes.data_as(ctypes.POINTER(_u64))


class FlagCXTransport(Transport):
    """One P2P engine per worker; writes are one-sided into the peer's registered memory."""

    name = "flagcx"

    def __init__(self, library: FlagCXLibrary, advertise_host: str = "127.0.0.1") -> None:
        self.library = library
        self.host = advertise_host
        self.engine = library.lib.flagcxP2pRpcEngineCreate()
        if not self.engine:
            raise TransportError("flagcxP2pRpcEngineCreate failed (no RDMA device, or the "
                                 "accelerator runtime is missing); see FLAGCX_DEBUG=INFO")
        self._serving = False

    def register(self, address: int, size: int) -> None:
        mr = _u64(0)
        rc = self.library.lib.flagcxP2pRpcRegister(self.engine, address, size, ctypes.byref(mr))
        if rc != 0:
            raise TransportError(f"flagcxP2pRpcRegister({address:#x}, {size}) failed: "
                                 f"{self.library.error(rc)}")

    def describe(self) -> bytes:
        # Peers connect after the handshake, so every region is registered by now: the
        # engine sends its region table to each peer when it accepts the connection.
        if not self._serving:
            rc = self.library.lib.flagcxP2pRpcStartServer(self.engine)
            if rc != 0:
                raise TransportError(f"flagcxP2pRpcStartServer failed: {self.library.error(rc)}")
            self._serving = True
        return f"{self.host}:{self.library.lib.flagcxP2pRpcGetPort(self.engine)}".encode()

    def connect(self, peer: bytes) -> _Conn:
        session = peer.decode()
        handle = self.library.lib.flagcxP2pRpcGetConn(self.engine, peer)
        if not handle:
            raise TransportError(f"flagcxP2pRpcGetConn({session!r}) failed")
        return _Conn(handle, session)

    def write(self, handle: object, src: np.ndarray, dst: np.ndarray,
              length: np.ndarray) -> WriteResult:
        conn: _Conn = handle  # type: ignore[assignment]
        src, dst, length = (np.ascontiguousarray(a) for a in split_large(src, dst, length))
        if src.size == 0:
            return WriteResult(True)
        rc = self.library.lib.flagcxP2pRpcBatchWriteSync(conn.handle, int(src.size), _ptr(src),
                                                         _ptr(dst), _ptr(length))
        if rc != 0:
            return WriteResult(False, f"flagcxP2pRpcBatchWriteSync to {conn.session} failed: "
                                      f"{self.library.error(rc)}")
        return WriteResult(True, "", int(length.sum()))

    def close(self) -> None:
        if self.engine:
            self.library.lib.flagcxP2pRpcEngineDestroy(self.engine)
            self.engine = None


def create_transport(vllm_config: Any, tp_rank: int) -> FlagCXTransport:
    """``transport_factory`` entry (``transport: flagcx``); loads the library now."""
    extra = getattr(getattr(vllm_config, "kv_transfer_config", None),
                    "kv_connector_extra_config", None) or {}
    library = FlagCXLibrary(library_path(extra.get("flagcx_library")))
    return FlagCXTransport(library, str(extra.get("side_channel_host", "127.0.0.1")))
