"""The peer processes of the two-process benchmarks (B2a, B4), started with the tests'
``peers.spawned``.

Kept light: a spawned child imports numpy, the transport and the connector's worker half,
never vLLM. Commands arrive over a pipe; every loop is bounded by the parent's timeouts.
"""

from __future__ import annotations

import zlib
from typing import Any


def host_pool(conn: Any, nbytes: int) -> None:
    """Register a zeroed host pool; answer ("crc", [(addr, len), ...]) with a crc32 over
    those ranges, until "stop"."""
    import ctypes

    import numpy as np

    from vllm_flagcx.transport.local import LocalTransport

    pool = np.zeros(nbytes, dtype=np.uint8)
    pool[:: 4096] = 0  # touch every page: the first write should not pay page faults
    transport = LocalTransport()
    transport.register(pool.ctypes.data, nbytes)
    conn.send((transport.describe(), pool.ctypes.data))
    while (command := conn.recv()) != "stop":
        _, ranges = command
        crc = 0
        for addr, length in ranges:
            crc = zlib.crc32(ctypes.string_at(addr, length), crc)
        conn.send(crc)
    transport.close()


def prefill_side_channel(conn: Any, port: int, num_blocks: int) -> None:
    """A prefill worker half serving the side channel on ``port`` with the Qwen3.6 region
    table (40 regions of one TP-8 rank); runs until "stop"."""
    from benchmarks import layout as L
    from vllm_flagcx.connector.worker import WorkerHalf, WorkerSettings
    from vllm_flagcx.transport.local import LocalTransport

    half = WorkerHalf(WorkerSettings(engine_id="bench-prefill", tp_rank=0, tp_size=L.TP,
                                     layout=layout_facts(), side_channel_port=port),
                      LocalTransport())
    half.register_regions(L.rank_layout(num_blocks).regions, serve=True)
    conn.send("ready")
    conn.recv()
    half.shutdown()


def keyed_prefill_side_channel(conn: Any, port: int, num_blocks: int, secret: str) -> None:
    """``prefill_side_channel`` with a side-channel secret (MAC + CURVE; "" for none);
    its first message is its pid (for its RSS)."""
    import os

    from benchmarks import layout as L
    from vllm_flagcx.connector.worker import WorkerHalf, WorkerSettings
    from vllm_flagcx.transport.local import LocalTransport
    from vllm_flagcx.wire import auth

    key = auth.load_key(environ={auth.SECRET_ENV: secret}) if secret else None
    half = WorkerHalf(WorkerSettings(engine_id="bench-prefill", tp_rank=0, tp_size=L.TP,
                                     layout=layout_facts(), side_channel_port=port, key=key),
                      LocalTransport())
    half.register_regions(L.rank_layout(num_blocks).regions, serve=True)
    conn.send(os.getpid())
    conn.recv()
    half.shutdown()


def layout_facts() -> Any:
    from benchmarks import layout as L
    from vllm_flagcx.wire import handshake as hs

    return hs.LayoutFacts(model="Qwen/Qwen3.6-35B-A3B", dtype="bfloat16",
                          kv_cache_dtype="fp8_e4m3",
                          group_kinds=("full_attention",) + ("mamba",) * L.GDN_GROUPS,
                          block_sizes=(L.BLOCK_TOKENS,) * L.NUM_GROUPS,
                          kernel_block_sizes=(L.BLOCK_TOKENS,) * L.NUM_GROUPS,
                          page_bytes=(L.PAGE * L.TP,) * L.NUM_GROUPS, conv_layout="DS",
                          num_kv_heads=L.KV_HEADS, cache_format="FLASH_ATTN:layout=HND")
