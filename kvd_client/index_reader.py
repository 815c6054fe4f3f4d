"""Reading a namespace's shared index (kvd_proto/index_layout.py) in the engine's process.

Lookups are local and lock-free: a probe of the hash buckets, a key comparison and a second
read of the slot's meta word that proves the answer consistent. Nothing here writes to the
index (the mapping is read-only; the daemon sealed the file). What keeps a READY slot
readable while a copy runs is the session's published epoch (`Marks`), not a lock.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from typing import NamedTuple

from kvd_proto.index_layout import (
    MARKS_BYTES,
    MAX_PROBE,
    RECLAIM_EPOCH_OFFSET,
    RESET_EPOCH_OFFSET,
    STATE_FREE,
    STATE_READY,
    STATE_STORING,
    Header,
    key_hash,
)

__all__ = ["STATE_FREE", "STATE_READY", "STATE_STORING", "Found", "IndexReader", "Marks"]

_FENCE = threading.Lock()


class Found(NamedTuple):
    state: int        # STATE_READY or STATE_STORING
    slot: int
    offset: int       # the slot's pool offset


class IndexReader:
    """A read-only mapping of one namespace's index (owns the descriptor)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        self.header = h = Header.unpack(self._map[:64])
        if h.file_bytes > size:
            raise ValueError(f"index file of {size} bytes is smaller than its layout says")
        view = memoryview(self._map)
        self._buckets = view[h.buckets_offset:h.buckets_offset + 4 * h.buckets].cast("I")
        self._meta = view[h.meta_offset:h.meta_offset + 8 * h.capacity].cast("Q")
        self._keys = view[h.keys_offset:h.keys_offset + h.key_width * h.capacity]
        self._epochs = view[RESET_EPOCH_OFFSET:RECLAIM_EPOCH_OFFSET + 8].cast("Q")
        self._mask = h.buckets - 1
        self._width = h.key_width

    @property
    def reset_epoch(self) -> int:
        return self._epochs[0]

    @property
    def reclaim_epoch(self) -> int:
        return self._epochs[1]

    def find(self, key: bytes) -> Found | None:
        """The key's slot if it is stored (READY) or being stored (STORING), else None."""
        n = len(key)
        if n > self._width:
            return None
        buckets, meta, keys, width = self._buckets, self._meta, self._keys, self._width
        b = key_hash(key) & self._mask
        for _ in range(MAX_PROBE):
            v = buckets[b]
            if not v:
                return None
            slot = v - 1
            word = meta[slot]
            if word & 3 and (word >> 2) & 0xFF == n:
                start = slot * width
                if keys[start:start + n] == key and meta[slot] == word:
                    return Found(word & 3, slot, self.header.offset_of(slot))
            b = (b + 1) & self._mask
        return None

    def close(self) -> None:
        for view in (self._buckets, self._meta, self._keys, self._epochs):
            view.release()
        with contextlib.suppress(BufferError):   # a view alive elsewhere: the GC unmaps it
            self._map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Marks:
    """This session's marks file: publishes the oldest reclaim epoch it may still act on."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map = mmap.mmap(fd, MARKS_BYTES, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = memoryview(self._map)[0:8].cast("Q")
        self.published = 0

    def publish(self, epoch: int) -> None:
        """Store `epoch`, then fence: the daemon must see it before this process reads any
        index entry it guards (a store followed by loads needs a full barrier)."""
        if epoch != self.published:
            self._view[0] = epoch
            self.published = epoch
            _FENCE.acquire()
            _FENCE.release()

    def close(self) -> None:
        self._view.release()
        with contextlib.suppress(BufferError):
            self._map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
