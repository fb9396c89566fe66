"""The decode-side process of the FlagCX binding tests (light: spawned children import only
this module, numpy and the binding)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vllm_flagcx.transport.flagcx import FlagCXLibrary, FlagCXTransport


def decode_side(conn, library: str, size: int) -> None:
    """Register a zeroed buffer with a real engine of ``library``, advertise, report."""
    buf = np.zeros(size, dtype=np.uint8)
    transport = FlagCXTransport(FlagCXLibrary(Path(library)))
    transport.register(buf.ctypes.data, size)
    conn.send((transport.describe(), buf.ctypes.data))
    conn.recv()
    conn.send(buf.tobytes())
    transport.close()
