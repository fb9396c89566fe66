"""Decode-side process of the GPU tests and benchmark (imports torch and the transport only)."""

from __future__ import annotations


def gpu_decode_side(conn, nbytes: int) -> None:
    import torch

    from vllm_flagcx.transport.local import LocalTransport

    buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    transport = LocalTransport()
    transport.register(buf.data_ptr(), nbytes)
    conn.send((transport.describe(), buf.data_ptr()))
    while True:
        command = conn.recv()
        if command == "stop":
            return
        torch.cuda.synchronize()
        conn.send(buf.cpu().numpy().tobytes() if command == "bytes" else None)
