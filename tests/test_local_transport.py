"""The same-host transport between two real processes: bytes land where planned."""

from __future__ import annotations

import numpy as np
import pytest
from testkit import peers

from vllm_flagcx.layout import plans, regions
from vllm_flagcx.transport.base import TransportError
from vllm_flagcx.transport.local import IOV_MAX, LocalTransport


@pytest.fixture
def decode_process():
    size = 1 << 20
    with peers.spawned(peers.decode_side, size) as (conn, (desc, base)):
        yield conn, desc, base, size


def test_scattered_and_coalesced_writes_across_processes(decode_process):
    conn, desc, d_base, size = decode_process
    block = 4096
    src_buf = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    p = LocalTransport()
    p.register(src_buf.ctypes.data, size)
    region = lambda base: regions.mla(layer="l", group=0, base=base, block_stride=block,  # noqa: E731
                                      num_blocks=size // block, page_bytes=block)
    p_ids = [3, 4, 5, 6, 40, 41, 100, 7]
    d_ids = [10, 11, 12, 13, 2, 90, 91, 0]
    plan = plans.plan_transfer(region(src_buf.ctypes.data), region(d_base), [p_ids], [d_ids],
                               plans.RankPair(0, 1, 0, 1))
    assert plan.num_descriptors == 5  # the 4-block run coalesced, 4 scattered
    result = p.write(p.connect(desc), plan.src, plan.dst, plan.length)
    assert result.ok and result.num_bytes == len(p_ids) * block
    conn.send("done")
    got = np.frombuffer(conn.recv(), dtype=np.uint8).reshape(-1, block)
    want = src_buf.reshape(-1, block)
    for pb, db in zip(p_ids, d_ids, strict=True):
        np.testing.assert_array_equal(got[db], want[pb])
    untouched = sorted(set(range(size // block)) - set(d_ids))
    assert not got[untouched].any()


def test_many_descriptors_are_chunked_at_iov_max(decode_process):
    conn, desc, d_base, _ = decode_process
    n = IOV_MAX * 2 + 7
    src_buf = np.arange(n * 8, dtype=np.uint8)
    p = LocalTransport()
    p.register(src_buf.ctypes.data, src_buf.nbytes)
    src = src_buf.ctypes.data + np.arange(n, dtype=np.uint64) * 8
    dst = d_base + np.arange(n, dtype=np.uint64) * 16  # gaps: nothing coalesces
    result = p.write(p.connect(desc), src, dst, np.full(n, 8, dtype=np.uint64))
    assert result.ok and result.num_bytes == n * 8
    conn.send("done")
    got = np.frombuffer(conn.recv(), dtype=np.uint8)[: n * 16].reshape(n, 16)
    np.testing.assert_array_equal(got[:, :8], src_buf.reshape(n, 8))


def test_out_of_range_and_foreign_host_are_refused():
    p = LocalTransport()
    buf = np.zeros(64, dtype=np.uint8)
    p.register(buf.ctypes.data, 64)
    peer = p.connect(p.describe())
    bad = p.write(peer, np.array([buf.ctypes.data], dtype=np.uint64),
                  np.array([buf.ctypes.data + 60], dtype=np.uint64),
                  np.array([8], dtype=np.uint64))
    assert not bad.ok and "destination outside" in bad.error
    import msgspec

    from vllm_flagcx.transport import local

    foreign = msgspec.msgpack.encode(local._Description("other-host", 1, ()))
    with pytest.raises(TransportError, match="transport='flagcx'"):
        p.connect(foreign)
    with pytest.raises(TransportError, match="address and size must be > 0"):
        p.register(0, 10)
