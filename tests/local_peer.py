"""The decode-side process of the local-transport tests (kept light: spawned children
import only this module, numpy and the transport)."""

from __future__ import annotations

import numpy as np

from vllm_flagcx.transport.local import LocalTransport


def decode_side(conn, size):
    """Register a zeroed buffer, advertise it, and send back what arrived."""
    buf = np.zeros(size, dtype=np.uint8)
    transport = LocalTransport()
    transport.register(buf.ctypes.data, size)
    conn.send((transport.describe(), buf.ctypes.data))
    conn.recv()  # the writer is done
    conn.send(buf.tobytes())
