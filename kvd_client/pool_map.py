"""This process's mapping of the daemon's pool (from the fd received at attach)."""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Any


class PoolMapping:
    """MAP_SHARED read/write mapping of the whole pool; owns (and closes) the fd."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self._map: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED,
                                                mmap.PROT_READ | mmap.PROT_WRITE)

    def _check(self, offset: int, length: int) -> mmap.mmap:
        if self._map is None:
            raise ValueError("pool mapping is closed")
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"range [{offset}, {offset + length}) outside the "
                             f"{self.size}-byte pool")
        return self._map

    def view(self, offset: int, length: int) -> memoryview:
        return memoryview(self._check(offset, length))[offset:offset + length]

    def numpy(self, offset: int = 0, length: int | None = None) -> Any:
        import numpy as np

        length = self.size - offset if length is None else length
        m = self._check(offset, length)
        return np.frombuffer(m, dtype=np.uint8, count=length, offset=offset)

    @property
    def closed(self) -> bool:
        return self._map is None

    def close(self) -> None:
        if self._map is not None:
            # Views still alive (e.g. numpy arrays) keep it mapped; the GC unmaps later.
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
