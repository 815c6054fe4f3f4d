"""Page-aligned I/O buffers the disk tier reuses.

Direct I/O needs page-aligned memory, and a fresh anonymous mapping per block costs its page
faults and zeroing every time (measured by bench/tiers.py: mmap + copy + close moved 2-2.5 GB/s
against 14-50 GB/s into a buffer used before), which is the drive's own speed. Buffers go back
to a free list per size once their I/O ends; the tier's queue bound (bytes in flight) bounds
how many exist, and the free lists are trimmed to `keep_bytes`.
"""

from __future__ import annotations

import mmap
import threading


class AlignedBuffers:
    """Free lists of page-aligned buffers by size; thread-safe."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[mmap.mmap]] = {}
        self._kept = 0

    def take(self, size: int) -> mmap.mmap:
        with self._lock:
            free = self._free.get(size)
            if free:
                self._kept -= size
                return free.pop()
        return mmap.mmap(-1, size)

    def give(self, buf: mmap.mmap) -> None:
        size = len(buf)
        with self._lock:
            if self._kept + size <= self.keep_bytes:
                self._free.setdefault(size, []).append(buf)
                self._kept += size
                return
        buf.close()

    def close(self) -> None:
        with self._lock:
            for free in self._free.values():
                for buf in free:
                    buf.close()
            self._free.clear()
            self._kept = 0
