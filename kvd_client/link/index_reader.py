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

from kvd_proto.barrier import fence
from kvd_proto.below_layout import BelowHeader
from kvd_proto.index_layout import (
    KEY_LEN_MASK,
    KEY_LEN_SHIFT,
    MARKS_BYTES,
    RECLAIM_EPOCH_OFFSET,
    RESET_EPOCH_OFFSET,
    STATE_FREE,
    STATE_MASK,
    STATE_READY,
    STATE_STORING,
    Header,
)
from kvd_proto.native import probe

__all__ = ["STATE_FREE", "STATE_READY", "STATE_STORING", "BelowMap", "IndexReader", "Marks"]

MEMO_LIMIT = 1 << 17       # keys remembered by `find` (cleared when full: a bound, not a cache
                           # policy; about 25 MiB at the limit)


class IndexReader:
    """A read-only mapping of one namespace's index (owns the descriptor).

    `find` remembers where it found a key, with the slot's meta word at that time: the word
    holds the slot's generation, which every insert and removal changes, so an unchanged word
    proves the slot still holds the key in the same state and one read answers a repeated
    lookup (the scheduler asks about a waiting request's blocks every step)."""

    def __init__(self, fd: int, *, memo_limit: int = MEMO_LIMIT) -> None:
        self.fd = fd
        size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        self.header = h = Header.unpack(self._map[:64])
        if h.file_bytes > size:
            raise ValueError(f"index file of {size} bytes is smaller than its layout says")
        view = memoryview(self._map)
        self._buckets = view[h.buckets_offset:h.buckets_offset + 4 * h.buckets].cast("I")
        self.meta = view[h.meta_offset:h.meta_offset + 8 * h.capacity].cast("Q")
        self._epochs = view[RESET_EPOCH_OFFSET:RECLAIM_EPOCH_OFFSET + 8].cast("Q")
        self._keys_offset = h.keys_offset
        self._mask = h.buckets - 1
        self._width = h.key_width
        self._per_extent, self._extent_bytes, self._stride = \
            h.per_extent, h.extent_bytes, h.stride
        # key -> (slot, meta word, offset): valid while meta[slot] still reads that word
        self.memo: dict[bytes, tuple[int, int, int]] = {}
        self.memo_limit = memo_limit

    @property
    def mapping(self) -> mmap.mmap:
        """The read-only mapping (kvd_proto.native.Lookups binds it)."""
        return self._map

    @property
    def reset_epoch(self) -> int:
        return self._epochs[0]

    @property
    def reclaim_epoch(self) -> int:
        return self._epochs[1]

    def find(self, key: bytes) -> tuple[int, int] | None:
        """(state, pool offset) of the key's slot if it is stored (STATE_READY) or being
        stored (STATE_STORING), else None."""
        memo = self.memo.get(key)
        if memo is not None:
            slot, word, offset = memo
            if self.meta[slot] == word:
                return word & STATE_MASK, offset
        found = probe(self._buckets, self.meta, self._map, self._keys_offset, self._width,
                      self._mask, key)
        if found is None:
            return None
        slot, word = found
        offset = self.header.offset_of(slot)
        if len(self.memo) >= self.memo_limit:
            self.memo.clear()
        self.memo[key] = (slot, word, offset)
        return word & STATE_MASK, offset

    def expect_ready(self, key: bytes, offset: int) -> None:
        """This engine finished storing `key` into the slot at `offset`: remember the word the
        slot will hold once the daemon marks it READY (same generation), so the engine's own
        later lookup of it is one read. Nothing is remembered unless the slot holds `key`,
        being stored, right now (the daemon has published the store)."""
        extent, within = divmod(offset, self._extent_bytes)
        i, rest = divmod(within, self._stride)
        slot = extent * self._per_extent + i
        if rest or i >= self._per_extent or slot >= self.header.capacity:
            return
        word = self.meta[slot]
        n = len(key)
        if word & STATE_MASK != STATE_STORING or (word >> KEY_LEN_SHIFT) & KEY_LEN_MASK != n:
            return
        start = self._keys_offset + slot * self._width
        if self._map[start:start + n] != key or self.meta[slot] != word:
            return
        if len(self.memo) >= self.memo_limit:
            self.memo.clear()
        self.memo[key] = (slot, word & ~3 | STATE_READY, offset)

    def close(self) -> None:
        self.memo.clear()
        for view in (self._buckets, self.meta, self._epochs):
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
            fence()

    def close(self) -> None:
        self._view.release()
        with contextlib.suppress(BufferError):
            self._map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BelowMap:
    """A read-only mapping of the namespace's "held below" table (kvd_proto/below_layout.py;
    owns the descriptor); `kvd_proto.native.Lookups.bind_below` reads it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        size = os.fstat(fd).st_size
        self.mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        try:
            header = BelowHeader.unpack(self.mapping[:64])
            if header.file_bytes > size:
                raise ValueError(f"below table of {size} bytes is smaller than its layout "
                                 "says")
        except ValueError:
            self.mapping.close()
            raise

    def close(self) -> None:
        with contextlib.suppress(BufferError):   # a view alive elsewhere: the GC unmaps it
            self.mapping.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
