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

// Loads use ld.cv: a system-memory line is fetched again, never taken from L2 (another process
// may have rewritten the pool since this GPU last read it). Stores use st.wt: written through
// L2 to system memory. The data is touched once either way, so no reuse is lost.
template <typename W>
__device__ __forceinline__ void copy_words(const W* __restrict__ s, W* __restrict__ d,
                                           long long n) {
    // Four independent loads per thread before the stores keep enough bytes in flight to
    // cover PCIe latency with few blocks.
    long long i = threadIdx.x;
    const long long step = blockDim.x;
    for (; i + 3 * step < n; i += 4 * step) {
        W a = __ldcv(s + i), b = __ldcv(s + i + step);
        W c = __ldcv(s + i + 2 * step), e = __ldcv(s + i + 3 * step);
        __stwt(d + i, a); __stwt(d + i + step, b);
        __stwt(d + i + 2 * step, c); __stwt(d + i + 3 * step, e);
    }
    for (; i < n; i += step) __stwt(d + i, __ldcv(s + i));
}

// table = [src x runs | dst x runs | len x runs]; blocks stride over runs. A run is a byte
// head up to the first address where source and destination are both `w`-aligned, a body
// of w-byte words (w = 16, 8, 4 or 1: the widest on which both addresses agree), and a
// byte tail. packing.run_parts is the same arithmetic in numpy.
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
        typedef unsigned char u8;
        const u8* sb = (const u8*)s;
        u8* db = (u8*)d;
        copy_words(sb, db, head);
        const u8* sw = sb + head;
        u8* dw = db + head;
        if (w == 16) copy_words((const uint4*)sw, (uint4*)dw, body);
        else if (w == 8) copy_words((const u64*)sw, (u64*)dw, body);
        else if (w == 4) copy_words((const unsigned int*)sw, (unsigned int*)dw, body);
        else copy_words(sw, dw, body);
        copy_words(sw + body * w, dw + body * w, tail);
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
