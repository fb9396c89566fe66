"""A/B on the GPU: one prefill-like write (8,192 descriptors of 32 KiB, 256 MiB: the
dense-wide model's 8k prompt) from a thread that never made a CUDA context current, as the
side channel writes; the first write and the median of the 5 after it (README.md here)."""

from __future__ import annotations

import statistics
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, "tests")
from testkit import peers  # the test kit lives under tests/

from vllm_flagcx.transport.local import LocalTransport

NBYTES, BLOCK, N = 512 << 20, 32768, 8192


def main() -> None:
    with peers.spawned(peers.gpu_decode_side, NBYTES, start_timeout=120,
                       stop="stop") as (_conn, (desc, base)):
        src = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        p = LocalTransport()
        p.register(src.data_ptr(), NBYTES)
        rng = np.random.default_rng(1)
        pick = rng.permutation(NBYTES // BLOCK)[:N].astype(np.uint64) * np.uint64(BLOCK)
        put = rng.permutation(NBYTES // BLOCK)[:N].astype(np.uint64) * np.uint64(BLOCK)
        s, d = np.uint64(src.data_ptr()) + pick, np.uint64(base) + put
        length = np.full(N, BLOCK, np.uint64)
        handle = p.connect(desc)
        times: list[float] = []

        def writes() -> None:
            for _ in range(6):
                started = time.perf_counter()
                result = p.write(handle, s, d, length)
                times.append((time.perf_counter() - started) * 1e3)
                assert result.ok, result.error

        writer = threading.Thread(target=writes)
        writer.start()
        writer.join()
        print(f"{sys.argv[1]}: side-channel-thread write of {N} x 32 KiB: first "
              f"{times[0]:.2f} ms, then median {statistics.median(times[1:]):.3f} ms "
              f"({[round(x, 2) for x in times]})")


if __name__ == "__main__":
    main()
