"""One batched copy launch for many descriptors: a tiny CUDA kernel compiled by NVRTC.

Why: a ``cuMemcpyDtoDAsync`` per descriptor costs ~5 us of submission each, so a 32k-token
request cut into 20,910 descriptors moves at ~2 GB/s on an H200 whose copy rate is ~2 TB/s.
One launch that reads the descriptor arrays on the device removes the per-descriptor cost.

The kernel takes (dst, src, length) arrays of absolute device addresses (any lengths, any
alignment; 16-byte words where all three are 16-byte aligned) with ``blockIdx.y`` walking
the descriptors and ``blockIdx.x`` splitting long ones, so both a few large and many small
descriptors fill the GPU. It is compiled once per device to a cubin for that device's
architecture (no PTX JIT, so a newer NVRTC than the driver is not a problem) from NVRTC
found next to the CUDA runtime (``libnvrtc.so*``, also the ``nvidia-cuda-nvrtc`` wheel that
PyTorch pulls in). Without NVRTC the caller falls back to one memcpy per descriptor.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from typing import Any

import numpy as np

KERNEL_NAME = b"vllm_flagcx_batched_copy"
CHECKED_KERNEL_NAME = b"vllm_flagcx_checked_copy"
DIGEST_KERNEL_NAME = b"vllm_flagcx_digest"
# a digest tile's fields (compat.kv_views.digest_tiles): base, block stride, token stride,
# row stride, word stride (bytes), tokens per block, blocks, first id, rows, words per
# row, first global row, row salt, word bytes, output slot
DIGEST_TILE_WORDS = 14
DIGEST_CHUNK_ELEMENTS = 256 * 16  # elements one block of threads takes per grid step
KERNEL_SOURCE = rb"""
// One warp per descriptor (blockIdx.y and the warp index walk the descriptors), split over
// blockIdx.x when long: a KV block of a few KiB is a few loads per lane, not a whole block
// of 256 threads that mostly idles. Four independent 16-byte loads are issued before
// their stores, so every lane keeps four requests in flight. MAX_REGIONS comes from the
// Python constant of that name (an NVRTC -D option), so the two cannot disagree.

__device__ __forceinline__ void copy_bytes(unsigned long long out, unsigned long long in,
    unsigned long long bytes, unsigned long long lane, unsigned long long lanes) {
  if (((out | in | bytes) & 15ULL) == 0) {
    uint4* o = (uint4*)out;
    const uint4* i = (const uint4*)in;
    const unsigned long long words = bytes >> 4;
    unsigned long long w = lane;
    for (; w + 3 * lanes < words; w += 4 * lanes) {
      const uint4 a = i[w], b = i[w + lanes], c = i[w + 2 * lanes], e = i[w + 3 * lanes];
      o[w] = a; o[w + lanes] = b; o[w + 2 * lanes] = c; o[w + 3 * lanes] = e;
    }
    for (; w < words; w += lanes) o[w] = i[w];
  } else {
    char* o = (char*)out;
    const char* i = (const char*)in;
    for (unsigned long long b = lane; b < bytes; b += lanes) o[b] = i[b];
  }
}

// The walk both kernels share: the table's three columns (dst[n], src[n], len[n]), this
// lane's place among the warps a descriptor is split over (blockIdx.x), and the
// descriptors this warp takes in turn (first, first + step, ...).
struct Walk {
  const unsigned long long *dst, *src, *len;
  unsigned long long lane, lanes, first, step;
  __device__ Walk(const unsigned long long* table, unsigned long long n)
      : dst(table), src(table + n), len(table + 2 * n),
        lane((unsigned long long)blockIdx.x * 32 + (threadIdx.x & 31)),
        lanes((unsigned long long)gridDim.x * 32),
        first((unsigned long long)blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5)),
        step((unsigned long long)gridDim.y * (blockDim.x >> 5)) {}
};

extern "C" __global__ void vllm_flagcx_batched_copy(
    const unsigned long long* __restrict__ table, unsigned long long n) {
  const Walk w(table, n);
  for (unsigned long long d = w.first; d < n; d += w.step)
    copy_bytes(w.dst[d], w.src[d], w.len[d], w.lane, w.lanes);
}

// The region (of `count`, in shared memory) holding [start, start + bytes) whole, or -1;
// an end that wraps past 2**64 is held by none. Warp-uniform: every lane of the warp asks
// about the same descriptor and tests 32 regions at once (one ballot per 32 regions).
__device__ __forceinline__ int region_of(unsigned long long start, unsigned long long bytes,
    const unsigned long long* lo, const unsigned long long* hi, unsigned count) {
  const unsigned long long end = start + bytes;
  if (end < start) return -1;
  for (unsigned base = 0; base < count; base += 32) {
    const unsigned r = base + (threadIdx.x & 31);
    const unsigned hits = __ballot_sync(0xffffffffu, r < count && lo[r] <= start && end <= hi[r]);
    if (hits) return (int)(base + __ffs(hits) - 1);
  }
  return -1;
}

// The write of addresses that crossed a process boundary: every descriptor's source must
// lie whole in one of this process's registered regions and its destination in one of the
// peer's, checked here before it is copied (no host pass over the descriptors); the
// destination is the peer's address plus that region's mapping delta (mod 2**64). A
// descriptor outside is not copied and raises refused[0] (source) or refused[1]
// (destination), which the host reads after the stream synchronises and turns into a
// failed write. regions: src lo[ns], src hi[ns], dst lo[nd], dst hi[nd], dst delta[nd].
extern "C" __global__ void vllm_flagcx_checked_copy(
    const unsigned long long* __restrict__ table, unsigned long long n,
    const unsigned long long* __restrict__ regions, unsigned ns, unsigned nd,
    unsigned* __restrict__ refused) {
  __shared__ unsigned long long s_lo[MAX_REGIONS], s_hi[MAX_REGIONS];
  __shared__ unsigned long long d_lo[MAX_REGIONS], d_hi[MAX_REGIONS], d_delta[MAX_REGIONS];
  if (ns > MAX_REGIONS || nd > MAX_REGIONS) {  // never from region_table; refuse, copy none
    if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0) refused[0] = refused[1] = 1;
    return;
  }
  for (unsigned k = threadIdx.x; k < ns; k += blockDim.x) {
    s_lo[k] = regions[k]; s_hi[k] = regions[ns + k];
  }
  for (unsigned k = threadIdx.x; k < nd; k += blockDim.x) {
    d_lo[k] = regions[2 * ns + k]; d_hi[k] = regions[2 * ns + nd + k];
    d_delta[k] = regions[2 * ns + 2 * nd + k];
  }
  __syncthreads();
  const Walk w(table, n);
  for (unsigned long long d = w.first; d < n; d += w.step) {
    const unsigned long long out = w.dst[d], in = w.src[d], bytes = w.len[d];
    const int s = region_of(in, bytes, s_lo, s_hi, ns);
    const int k = region_of(out, bytes, d_lo, d_hi, nd);
    if (s < 0 || k < 0) {
      if ((threadIdx.x & 31) == 0 && blockIdx.x == 0) {
        if (s < 0) refused[0] = 1;
        if (k < 0) refused[1] = 1;
      }
      continue;
    }
    copy_bytes(out + d_delta[k], in, bytes, w.lane, w.lanes);
  }
}

// The full logical digest (layout/digest.py): per tile (one part of one layer over one
// request's blocks), the sum over its words of word * w(word) * w(token) * w(row), added
// (mod 2**64: unsigned wrap, so the order of atomics cannot change it) to its slot.
__device__ __forceinline__ unsigned long long mix64(unsigned long long x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return (x ^ (x >> 31)) | 1ULL;
}

extern "C" __global__ void vllm_flagcx_digest(const unsigned long long* __restrict__ tiles,
    const long long* __restrict__ ids, unsigned long long* __restrict__ out) {
  const unsigned long long* t = tiles + (unsigned long long)blockIdx.x * DIGEST_TILE_WORDS;
  const long long base = (long long)t[0], block_stride = (long long)t[1];
  const long long token_stride = (long long)t[2], row_stride = (long long)t[3];
  const long long word_stride = (long long)t[4];
  const unsigned long long per_block = t[5], blocks = t[6], ids_at = t[7], rows = t[8];
  const unsigned long long words = t[9], first_row = t[10], salt = t[11], word_bytes = t[12];
  const unsigned long long total = blocks * per_block * rows * words;
  unsigned long long acc = 0;
  for (unsigned long long e = (unsigned long long)blockIdx.y * blockDim.x + threadIdx.x;
       e < total; e += (unsigned long long)gridDim.y * blockDim.x) {
    const unsigned long long w = e % words, q = e / words;
    const unsigned long long r = q % rows, token = q / rows;
    const unsigned long long slot = token % per_block, blk = token / per_block;
    const char* p = (const char*)(base + ids[ids_at + blk] * block_stride
                                  + (long long)slot * token_stride + (long long)r * row_stride
                                  + (long long)w * word_stride);
    unsigned long long x;
    if (word_bytes == 8) x = (unsigned long long)*(const long long*)p;
    else if (word_bytes == 4) x = (unsigned long long)(long long)*(const int*)p;
    else if (word_bytes == 2) x = (unsigned long long)(long long)*(const short*)p;
    else x = (unsigned long long)(long long)*(const signed char*)p;
    acc += x * mix64(w ^ DIGEST_WORD_SALT) * mix64(token ^ DIGEST_TOKEN_SALT)
           * mix64((first_row + r) ^ salt);
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0 && acc) atomicAdd(out + t[13], acc);
}
"""
THREADS = 256
WARPS = THREADS // 32  # descriptors one block works on at once
BYTES_PER_SPLIT = 32 * 4 * 16 * 4  # one warp: 32 lanes x 4 in flight x 16 B, 4 rounds
MAX_SPLIT = 64  # warps per descriptor at most (blockIdx.x)
MAX_GRID_Y = 65535
MAX_REGIONS = 256  # registered regions per side the checked kernel holds (its MAX_REGIONS)
SOURCE_OUTSIDE, DESTINATION_OUTSIDE = 0, 1  # the checked kernel's refusal words
CU_MEMHOSTALLOC_DEVICEMAP = 0x02
_NO_WORDS = np.zeros(0, np.uint64)  # ``_upload``'s head for the plain kernel
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


class KernelUnavailable(RuntimeError):
    """NVRTC or the compiled kernel is not usable here; the message says why."""


def _nvrtc_candidates() -> list[str]:
    names = ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    for root in sys.path:
        names += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*")))
        names += sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "lib", "libnvrtc.so*")))
    return [n for n in names if "builtins" not in n and "alt" not in os.path.basename(n)]


def load_nvrtc() -> ctypes.CDLL:
    tried = []
    for name in _nvrtc_candidates():
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            tried.append(f"{name}: {exc}")
    raise KernelUnavailable("NVRTC (libnvrtc.so) not found; tried " + "; ".join(tried[:4]))


def compile_cubin(nvrtc: ctypes.CDLL, major: int, minor: int) -> bytes:
    """The kernel as a cubin for sm_<major><minor>."""
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), KERNEL_SOURCE, b"batched_copy.cu",
                                  0, None, None)
    if rc != 0:
        raise KernelUnavailable(f"nvrtcCreateProgram failed ({rc})")
    try:
        from vllm_flagcx.layout import digest

        flags = [f"--gpu-architecture=sm_{major}{minor}", "--std=c++14",
                 f"-DMAX_REGIONS={MAX_REGIONS}", f"-DDIGEST_TILE_WORDS={DIGEST_TILE_WORDS}",
                 f"-DDIGEST_WORD_SALT={digest.WORD_SALT}ULL",
                 f"-DDIGEST_TOKEN_SALT={digest.TOKEN_SALT}ULL"]
        options = (ctypes.c_char_p * len(flags))(*(f.encode() for f in flags))
        rc = nvrtc.nvrtcCompileProgram(prog, len(flags), options)
        if rc != 0:
            size = ctypes.c_size_t(0)
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise KernelUnavailable(f"NVRTC could not compile the copy kernel for "
                                    f"sm_{major}{minor} ({rc}): {log.value.decode()[:400]}")
        size = ctypes.c_size_t(0)
        if nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)) != 0 or size.value == 0:
            raise KernelUnavailable("this NVRTC cannot emit a cubin (nvrtcGetCUBINSize)")
        cubin = ctypes.create_string_buffer(size.value)
        if nvrtc.nvrtcGetCUBIN(prog, cubin) != 0:
            raise KernelUnavailable("nvrtcGetCUBIN failed")
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def launch_shape(n: int, longest: int) -> tuple[int, int]:
    """(grid x: warps per descriptor, grid y: blocks of ``WARPS`` descriptors). Long
    descriptors are split over up to ``MAX_SPLIT`` warps so that a few large copies still
    occupy every SM; many small ones share blocks, a warp each."""
    split = max(1, min(MAX_SPLIT, -(-longest // BYTES_PER_SPLIT)))
    return split, max(1, min(-(-n // WARPS), MAX_GRID_Y))


def region_table(sources: np.ndarray, destinations: np.ndarray) -> np.ndarray:
    """The checked kernel's region table: ``sources`` is (k, 2) [lo, hi) of this process's
    registered device regions, ``destinations`` (m, 3) [lo, hi, delta) of the peer's, delta
    what to add (mod 2**64) to a peer address to reach this process's mapping of it.
    Laid out as the kernel reads it: src lo, src hi, dst lo, dst hi, dst delta."""
    sources = np.asarray(sources, dtype=np.uint64).reshape(-1, 2)
    destinations = np.asarray(destinations, dtype=np.uint64).reshape(-1, 3)
    if len(sources) > MAX_REGIONS or len(destinations) > MAX_REGIONS:
        raise ValueError(f"the checked copy holds at most {MAX_REGIONS} regions per side "
                         f"(got {len(sources)} sources, {len(destinations)} destinations)")
    return np.concatenate([sources[:, 0], sources[:, 1], destinations[:, 0],
                           destinations[:, 1], destinations[:, 2]])


class BatchedCopy:
    """The compiled kernel for one device plus a per-thread device descriptor table.

    ``check`` is the driver's error checker (raises ``CudaError`` naming the call).
    """

    def __init__(self, lib: ctypes.CDLL, check: Any, device: int) -> None:
        self._lib, self._check = lib, check
        dev = ctypes.c_int(0)
        check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        check(lib.cuDeviceGetAttribute(ctypes.byref(major),
                                       CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
              "cuDeviceGetAttribute")
        check(lib.cuDeviceGetAttribute(ctypes.byref(minor),
                                       CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
              "cuDeviceGetAttribute")
        cubin = compile_cubin(load_nvrtc(), major.value, minor.value)
        self._module, self._function = ctypes.c_void_p(), ctypes.c_void_p()
        check(lib.cuModuleLoadData(ctypes.byref(self._module), cubin), "cuModuleLoadData")
        check(lib.cuModuleGetFunction(ctypes.byref(self._function), self._module,
                                      KERNEL_NAME), "cuModuleGetFunction")
        self._checked, self._digest = ctypes.c_void_p(), ctypes.c_void_p()
        check(lib.cuModuleGetFunction(ctypes.byref(self._checked), self._module,
                                      CHECKED_KERNEL_NAME), "cuModuleGetFunction")
        check(lib.cuModuleGetFunction(ctypes.byref(self._digest), self._module,
                                      DIGEST_KERNEL_NAME), "cuModuleGetFunction")
        self._local = threading.local()

    def _grown(self, name: str, nbytes: int, alloc: Any, free: Any) -> int:
        """This thread's buffer ``name``, grown (never shrunk) to at least ``nbytes``:
        ``alloc(capacity)`` gives its address, ``free(address)`` releases the old one."""
        have = getattr(self._local, f"{name}_bytes", 0)
        if have < nbytes:
            if have:
                free(getattr(self._local, name))
            capacity = max(nbytes, 1 << 16, 2 * have)
            setattr(self._local, name, alloc(capacity))
            setattr(self._local, f"{name}_bytes", capacity)
        return int(getattr(self._local, name))

    def _device_alloc(self, capacity: int) -> int:
        ptr = ctypes.c_uint64(0)
        self._check(self._lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(capacity)),
                    "cuMemAlloc (batched copy buffer)")
        return ptr.value

    def _device_free(self, address: int) -> None:
        self._lib.cuMemFree_v2(ctypes.c_uint64(address))

    def _host_alloc(self, capacity: int) -> int:
        ptr = ctypes.c_void_p(0)
        self._check(self._lib.cuMemHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(capacity), 0),
                    "cuMemHostAlloc (batched copy buffer)")
        return int(ptr.value or 0)

    def _mapped_alloc(self, capacity: int) -> int:
        """Page-locked host memory the device writes into (the checked kernel's refusal
        words), as its device address; host and device addresses agree under unified
        addressing (64-bit Linux), which ``_refusals`` relies on and this checks."""
        host = ctypes.c_void_p(0)
        self._check(self._lib.cuMemHostAlloc(ctypes.byref(host), ctypes.c_size_t(capacity),
                                             CU_MEMHOSTALLOC_DEVICEMAP),
                    "cuMemHostAlloc (refusal words)")
        device = ctypes.c_uint64(0)
        self._check(self._lib.cuMemHostGetDevicePointer_v2(ctypes.byref(device), host, 0),
                    "cuMemHostGetDevicePointer")
        if device.value != (host.value or 0):
            self._lib.cuMemFreeHost(host)
            raise KernelUnavailable("mapped host memory has another device address (no "
                                    "unified addressing)")
        return int(host.value or 0)

    def _host_free(self, address: int) -> None:
        self._lib.cuMemFreeHost(ctypes.c_void_p(address))

    def _table(self, nbytes: int) -> int:
        """A device buffer of at least ``nbytes`` for this thread."""
        return self._grown("table", nbytes, self._device_alloc, self._device_free)

    def _staging(self, words: int) -> np.ndarray:
        """A page-locked host array of ``words`` uint64 for this thread: the table's
        upload is then a DMA, not a staged pageable copy (~50 us for 20,910 descriptors).
        Reused by the next ``run`` on this thread, which comes after the caller
        synchronised this one."""
        address = self._grown("pinned", words * 8, self._host_alloc, self._host_free)
        return np.ctypeslib.as_array((ctypes.c_uint64 * words).from_address(address))

    def gather(self, stream: ctypes.c_void_p, src: np.ndarray, length: np.ndarray) -> bytes:
        """The bytes of many small device ranges, in order, synchronised: one launch
        packs them into this thread's device scratch, one copy lands that in page-locked
        host memory. Why: the logical integrity sample reads ~64 element vectors of a few
        hundred bytes each, and a copy per range (or a torch gather per layer) costs
        ~1.5 ms on a GPU where this costs one launch and two small copies."""
        total = int(length.sum())
        scratch = self._grown("scratch", total, self._device_alloc, self._device_free)
        offsets = np.zeros(length.size, dtype=np.uint64)
        np.cumsum(length[:-1], out=offsets[1:])
        self.run(stream, np.uint64(scratch) + offsets, src, length)
        landing = self._grown("landing", total, self._host_alloc, self._host_free)
        self._check(self._lib.cuMemcpyDtoHAsync_v2(ctypes.c_void_p(landing),
                                                   ctypes.c_uint64(scratch),
                                                   ctypes.c_size_t(total), stream),
                    "cuMemcpyDtoHAsync (gathered ranges)")
        self._check(self._lib.cuStreamSynchronize(stream), "cuStreamSynchronize")
        return ctypes.string_at(landing, total)

    def _refusals(self) -> np.ndarray:
        """This thread's two refusal words (source, destination), zeroed."""
        address = self._grown("refusals", 8, self._mapped_alloc, self._host_free)
        words = np.ctypeslib.as_array((ctypes.c_uint32 * 2).from_address(address))
        words[:] = 0
        return words

    def run_checked(self, stream: ctypes.c_void_p, dst: np.ndarray, src: np.ndarray,
                    length: np.ndarray, regions: np.ndarray, sources: int,
                    destinations: int) -> np.ndarray:
        """Enqueue the checked copy of peer addresses ``dst`` (see the kernel) on
        ``stream``; the answer is the two refusal words, to read only after the caller
        synchronised the stream (non-zero: that side had a descriptor outside its regions,
        and that descriptor was not copied). ``regions`` is ``region_table``'s."""
        table = self._upload(stream, regions, dst, src, length)
        refused = self._refusals()
        self._launch(stream, self._checked, "checked copy", length,
                     (ctypes.c_uint64(table + 8 * regions.size), ctypes.c_uint64(dst.size),
                      ctypes.c_uint64(table), ctypes.c_uint32(sources),
                      ctypes.c_uint32(destinations), ctypes.c_uint64(refused.ctypes.data)))
        return refused

    def run(self, stream: ctypes.c_void_p, dst: np.ndarray, src: np.ndarray,
            length: np.ndarray) -> None:
        """Enqueue the copy on ``stream`` (the caller synchronises before the next
        ``run`` on this thread)."""
        table = self._upload(stream, _NO_WORDS, dst, src, length)
        self._launch(stream, self._function, "batched copy", length,
                     (ctypes.c_uint64(table), ctypes.c_uint64(dst.size)))

    def digest(self, stream: ctypes.c_void_p, tiles: np.ndarray, ids: np.ndarray,
               slots: int) -> np.ndarray:
        """The full digest's ``slots`` sums over ``tiles`` (``DIGEST_TILE_WORDS`` uint64
        each) and the block ids they index, in one launch; synchronised."""
        n = int(tiles.size) // DIGEST_TILE_WORDS
        host = self._staging(int(tiles.size) + int(ids.size) + slots)
        host[:tiles.size] = tiles.reshape(-1)
        host[tiles.size:tiles.size + ids.size] = ids.astype(np.int64).view(np.uint64)
        host[tiles.size + ids.size:] = 0
        table = self._table(host.nbytes)
        self._check(self._lib.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(table),
                                                   ctypes.c_void_p(host.ctypes.data),
                                                   ctypes.c_size_t(host.nbytes), stream),
                    "cuMemcpyHtoDAsync (digest tiles)")
        out = table + 8 * (int(tiles.size) + int(ids.size))
        shaped = tiles.reshape(n, DIGEST_TILE_WORDS)
        largest = int((shaped[:, 5] * shaped[:, 6] * shaped[:, 8] * shaped[:, 9]).max())
        chunks = max(1, min(MAX_GRID_Y, -(-largest // DIGEST_CHUNK_ELEMENTS)))
        args = (ctypes.c_uint64(table), ctypes.c_uint64(table + 8 * int(tiles.size)),
                ctypes.c_uint64(out))
        params = (ctypes.c_void_p * 3)(*(ctypes.cast(ctypes.byref(a), ctypes.c_void_p)
                                         for a in args))
        self._check(self._lib.cuLaunchKernel(self._digest, n, chunks, 1, THREADS, 1, 1, 0,
                                             stream, params, None), "cuLaunchKernel (digest)")
        result = np.zeros(slots, dtype=np.uint64)
        self._check(self._lib.cuMemcpyDtoHAsync_v2(ctypes.c_void_p(result.ctypes.data),
                                                   ctypes.c_uint64(out),
                                                   ctypes.c_size_t(8 * slots), stream),
                    "cuMemcpyDtoHAsync (digests)")
        self._check(self._lib.cuStreamSynchronize(stream), "cuStreamSynchronize")
        return result

    def _upload(self, stream: ctypes.c_void_p, head: np.ndarray, dst: np.ndarray,
                src: np.ndarray, length: np.ndarray) -> int:
        """Stage ``head`` and then the descriptor columns (dst, src, length) in this
        thread's page-locked buffer and enqueue their upload to its device table; the
        table's device address (``head`` at its start, the columns after it)."""
        n, r = int(dst.size), int(head.size)
        host = self._staging(r + 3 * n)
        host[:r] = head
        host[r:r + n], host[r + n:r + 2 * n], host[r + 2 * n:] = dst, src, length
        table = self._table(host.nbytes)
        self._check(self._lib.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(table),
                                                   ctypes.c_void_p(host.ctypes.data),
                                                   ctypes.c_size_t(host.nbytes), stream),
                    "cuMemcpyHtoDAsync (descriptor table)")
        return table

    def _launch(self, stream: ctypes.c_void_p, function: ctypes.c_void_p, what: str,
                length: np.ndarray, args: tuple[ctypes._SimpleCData, ...]) -> None:
        """Launch ``function`` over ``length.size`` descriptors (``launch_shape``) with
        ``args`` as its parameters."""
        split, rows = launch_shape(int(length.size), int(length.max()))
        params = (ctypes.c_void_p * len(args))(
            *(ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args))
        self._check(self._lib.cuLaunchKernel(function, split, rows, 1, THREADS, 1, 1, 0,
                                             stream, params, None),
                    f"cuLaunchKernel ({what})")
