"""Page-aligned I/O buffers the disk tier reuses.

Direct I/O needs page-aligned memory, and a fresh anonymous mapping per block costs its page
faults and zeroing every time (measured by bench/tiers.py: mmap + copy + close moved 2-2.5 GB/s
against 14-50 GB/s into a buffer used before), which is the drive's own speed. Buffers go back
to a free list per size once their I/O ends; the tier's queue bound (bytes in flight) bounds
how many exist (all of them are kept while the tier is busy: a buffer made fresh costs its
faults again), and `trim` lets the idle ones go once the tier has been quiet for IDLE_S.
"""

from __future__ import annotations

import mmap
import threading
import time

IDLE_S = 10.0            # no buffer taken this long: the free ones are let go (down to KEEP)
KEEP_IDLE_BYTES = 8 << 20
_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


class AlignedBuffers:
    """Free lists of page-aligned buffers by size; thread-safe."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[mmap.mmap]] = {}
        self._kept = 0
        self._taken_at = 0.0

    def take(self, size: int) -> mmap.mmap:
        with self._lock:
            self._taken_at = time.monotonic()
            free = self._free.get(size)
            if free:
                self._kept -= size
                return free.pop()
        # Populated at once: one trip into the kernel instead of a fault per page on first use.
        return mmap.mmap(-1, size, flags=_FLAGS)

    def give(self, buf: mmap.mmap) -> None:
        size = len(buf)
        with self._lock:
            if self._kept + size <= self.keep_bytes:
                self._free.setdefault(size, []).append(buf)
                self._kept += size
                return
        buf.close()

    def trim(self) -> None:
        """Let go of free buffers past KEEP_IDLE_BYTES once none was taken for IDLE_S."""
        with self._lock:
            if time.monotonic() - self._taken_at < IDLE_S or self._kept <= KEEP_IDLE_BYTES:
                return
            doomed = []
            for free in self._free.values():
                while free and self._kept > KEEP_IDLE_BYTES:
                    buf = free.pop()
                    self._kept -= len(buf)
                    doomed.append(buf)
        for buf in doomed:
            buf.close()

    def close(self) -> None:
        with self._lock:
            for free in self._free.values():
                for buf in free:
                    buf.close()
            self._free.clear()
            self._kept = 0
