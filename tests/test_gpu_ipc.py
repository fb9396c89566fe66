"""GPU memory between two processes on one GPU through the same-host transport (CUDA IPC).

Needs CUDA (skipped elsewhere; CI has no GPU). Run on the GPU machine with
``python3 -m pytest tests/test_gpu_ipc.py``.
"""

from __future__ import annotations

import numpy as np
import peers
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def decode_gpu():
    nbytes = 64 << 20
    with peers.spawned(peers.gpu_decode_side, nbytes, start_timeout=120, stop="stop") as (
            conn, (desc, base)):
        yield conn, desc, base, nbytes


def test_gpu_bytes_land_across_processes(decode_gpu):
    from vllm_flagcx.transport.local import LocalTransport

    conn, desc, d_base, nbytes = decode_gpu
    block = 1 << 16
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    p = LocalTransport()
    p.register(src.data_ptr(), nbytes)
    assert p.device_ranges and not p.ranges  # recognised as device memory
    p_ids = np.array([3, 4, 5, 6, 40, 100, 7, 900], dtype=np.uint64)
    d_ids = np.array([10, 11, 12, 13, 2, 90, 0, 901], dtype=np.uint64)
    result = p.write(p.connect(desc), src.data_ptr() + p_ids * block,
                     d_base + d_ids * block, np.full(p_ids.size, block, dtype=np.uint64))
    assert result.ok, result.error
    conn.send("bytes")
    got = np.frombuffer(conn.recv(), dtype=np.uint8).reshape(-1, block)
    want = src.cpu().numpy().reshape(-1, block)
    for pb, db in zip(p_ids.tolist(), d_ids.tolist(), strict=True):
        np.testing.assert_array_equal(got[db], want[pb])
    assert not got[[1, 8, 500]].any()
    outside = p.write(p.connect(desc), np.array([src.data_ptr()], dtype=np.uint64),
                      np.array([d_base + nbytes], dtype=np.uint64),
                      np.array([16], dtype=np.uint64))
    assert not outside.ok and "outside the GPU memory" in outside.error


def test_many_whole_block_descriptors_take_the_batched_launch(decode_gpu, monkeypatch):
    from vllm_flagcx.transport import cuda_ipc
    from vllm_flagcx.transport.local import LocalTransport

    monkeypatch.setenv(cuda_ipc.BATCHED_ENV, "1")
    conn, desc, d_base, nbytes = decode_gpu
    block = 4096
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    p = LocalTransport()
    p.register(src.data_ptr(), nbytes)
    rng = np.random.default_rng(3)
    n = 3 * cuda_ipc.BATCH_MIN
    p_ids = rng.permutation(nbytes // block)[:n].astype(np.uint64)
    d_ids = rng.permutation(nbytes // block)[:n].astype(np.uint64)
    result = p.write(p.connect(desc), src.data_ptr() + p_ids * block, d_base + d_ids * block,
                     np.full(n, block, dtype=np.uint64))
    assert result.ok, result.error
    conn.send("bytes")
    got = np.frombuffer(conn.recv(), dtype=np.uint8).reshape(-1, block)
    want = src.cpu().numpy().reshape(-1, block)
    np.testing.assert_array_equal(got[d_ids.astype(np.int64)], want[p_ids.astype(np.int64)])
