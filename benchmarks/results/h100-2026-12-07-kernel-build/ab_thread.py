"""A/B on the GPU: one prefill-like write (8,192 descriptors of 32 KiB, 256 MiB: the
dense-wide model's 8k prompt) from a thread that never touched CUDA, as the side channel
writes; median of 5 after the first."""
import statistics, sys, threading, time
import numpy as np, torch
sys.path.insert(0, "tests")
from testkit import peers
from vllm_flagcx.transport.local import LocalTransport

def main():
    nbytes, block, n = 512 << 20, 32768, 8192
    with peers.spawned(peers.gpu_decode_side, nbytes, start_timeout=120, stop="stop") as (conn, (desc, base)):
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        p = LocalTransport()
        p.register(src.data_ptr(), nbytes)
        rng = np.random.default_rng(1)
        s = np.uint64(src.data_ptr()) + rng.permutation(nbytes // block)[:n].astype(np.uint64) * np.uint64(block)
        d = np.uint64(base) + rng.permutation(nbytes // block)[:n].astype(np.uint64) * np.uint64(block)
        L = np.full(n, block, np.uint64)
        h = p.connect(desc)
        times = []
        def w():
            for _ in range(6):
                t = time.perf_counter(); r = p.write(h, s, d, L)
                times.append((time.perf_counter() - t) * 1e3); assert r.ok, r.error
        th = threading.Thread(target=w); th.start(); th.join()
        print(f"{sys.argv[1]}: side-channel-thread write of {n} x 32 KiB: first {times[0]:.2f} ms, "
              f"then median {statistics.median(times[1:]):.3f} ms ({[round(x, 2) for x in times]})")


if __name__ == "__main__":
    main()
