"""The gather/scatter kernel: one launch copies every run of a transfer.

CUDA C source compiled at first use by NVRTC through cupy (no build step; cupy caches the
binary under ~/.cupy/kernel_cache). Nothing here imports cupy until `KernelLauncher.load`.
The arithmetic (run splitting, widths, grid) is packing.py's, where the CPU tests cover it.
Host addresses in a table must be registered ranges of a device that can use host pointers
(chain.route decides); device addresses are the engine's KV tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .packing import THREADS

SOURCE = r"""
typedef unsigned long long u64;

template <typename W>
__device__ __forceinline__ void copy_words(const W* __restrict__ s, W* __restrict__ d,
                                           long long n) {
    // Four independent loads per thread before the stores keep enough bytes in flight to
    // cover PCIe latency with few blocks; __ldcs/__stcs stream past the caches the model uses.
    long long i = threadIdx.x;
    const long long step = blockDim.x;
    for (; i + 3 * step < n; i += 4 * step) {
        W a = __ldcs(s + i), b = __ldcs(s + i + step);
        W c = __ldcs(s + i + 2 * step), e = __ldcs(s + i + 3 * step);
        __stcs(d + i, a); __stcs(d + i + step, b);
        __stcs(d + i + 2 * step, c); __stcs(d + i + 3 * step, e);
    }
    for (; i < n; i += step) __stcs(d + i, __ldcs(s + i));
}

__device__ __forceinline__ void copy_bytes(const unsigned char* s, unsigned char* d,
                                           long long n) {
    for (long long i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}

// table = [src x runs | dst x runs | len x runs]; blocks stride over runs.
extern "C" __global__ void kvd_copy_runs(const u64 table_addr, const long long runs) {
    const long long* table = (const long long*)table_addr;
    for (long long r = blockIdx.x; r < runs; r += gridDim.x) {
        const u64 s = (u64)table[r];
        const u64 d = (u64)table[runs + r];
        const long long len = table[2 * runs + r];
        const u64 diff = s ^ d;
        const int w = (diff & 15) == 0 ? 16 : (diff & 7) == 0 ? 8 : (diff & 3) == 0 ? 4 : 1;
        long long head = (long long)((w - (s & (w - 1))) & (w - 1));
        if (head > len) head = len;
        const long long body = (len - head) / w;
        const long long tail = len - head - body * w;
        const unsigned char* sb = (const unsigned char*)s;
        unsigned char* db = (unsigned char*)d;
        copy_bytes(sb, db, head);
        const unsigned char* sw = sb + head;
        unsigned char* dw = db + head;
        if (w == 16) copy_words((const uint4*)sw, (uint4*)dw, body);
        else if (w == 8) copy_words((const u64*)sw, (u64*)dw, body);
        else if (w == 4) copy_words((const unsigned int*)sw, (unsigned int*)dw, body);
        else copy_bytes(sw, dw, body);
        copy_bytes(sw + body * w, dw + body * w, tail);
    }
}
"""

NAME = "kvd_copy_runs"


class KernelLauncher:
    """Compiles the kernel for one device and launches it on a given stream."""

    def __init__(self, device: int) -> None:
        self.device = device
        self._kernel: Any = None
        self._cupy: Any = None

    @property
    def ready(self) -> bool:
        return self._kernel is not None

    def load(self) -> None:
        """Compile (or take from cupy's disk cache) and load; raises on failure."""
        import cupy

        with cupy.cuda.Device(self.device):
            kernel = cupy.RawKernel(SOURCE, NAME, options=("-std=c++14",))
            kernel.compile()
        self._cupy = cupy
        self._kernel = kernel

    def launch(self, table_address: int, runs: int, blocks: int, stream_handle: int) -> None:
        """Enqueue one launch on `stream_handle` (a raw cudaStream_t)."""
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            stream = cupy.cuda.ExternalStream(stream_handle, self.device)
            self._kernel((blocks,), (THREADS,), (np.uint64(table_address), np.int64(runs)),
                         stream=stream)
