"""Processes the transport tests spawn, and how they are spawned.

Kept light: a spawned child imports this module, numpy and the transport under test, never
vLLM or the connector (seconds per start instead of tens).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Iterator
from typing import Any


def _transport(kind: str, library: str | None) -> Any:
    if kind == "flagcx":
        from pathlib import Path

        from vllm_flagcx.transport.flagcx import FlagCXLibrary, FlagCXTransport

        return FlagCXTransport(FlagCXLibrary(Path(library)), rdma_sysfs=None)  # stand-in
    from vllm_flagcx.transport.local import LocalTransport

    return LocalTransport()


def decode_side(conn: Any, size: int, kind: str = "local", library: str | None = None) -> None:
    """Register a zeroed host buffer, advertise it, send back what arrived when asked."""
    import numpy as np

    buf = np.zeros(size, dtype=np.uint8)
    transport = _transport(kind, library)
    transport.register(buf.ctypes.data, size)
    conn.send((transport.describe(), buf.ctypes.data))
    conn.recv()  # the writer is done
    conn.send(buf.tobytes())
    transport.close()


def gpu_decode_side(conn: Any, nbytes: int, pieces: int = 1) -> None:
    """The same with a CUDA buffer, registered in ``pieces`` equal ranges (several regions
    for the writer to tell apart); serves "bytes" requests until "stop"."""
    import torch

    from vllm_flagcx.transport.local import LocalTransport

    buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    transport = LocalTransport()
    piece = nbytes // pieces
    for k in range(pieces):
        transport.register(buf.data_ptr() + k * piece, piece if k < pieces - 1
                           else nbytes - k * piece)
    conn.send((transport.describe(), buf.data_ptr()))
    while (command := conn.recv()) != "stop":
        torch.cuda.synchronize()
        conn.send(buf.cpu().numpy().tobytes() if command == "bytes" else None)


@contextlib.contextmanager
def spawned(target: Any, *args: Any, start_timeout: float = 60,
            stop: str | None = None) -> Iterator[tuple[Any, Any]]:
    """Start ``target(conn, *args)`` in a spawned process; yield (conn, its first message)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    try:
        assert parent.poll(start_timeout), "peer process did not start"
        yield parent, parent.recv()
    finally:
        if stop is not None and proc.is_alive():
            with contextlib.suppress(OSError):
                parent.send(stop)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
