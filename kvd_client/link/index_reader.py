"""Reading a namespace's shared index (kvd_proto/index_layout.py) in the engine's process.

The mapping is read-only (the daemon sealed the file): nothing here writes to the index.
Lookups probe it through the session's `kvd_proto.native.Lookups` (compiled where built),
which binds this mapping: lock-free, a bucket, a key comparison and a second read of the
slot's meta word that proves the answer consistent. What keeps a READY slot readable while a
copy runs is the session's published epoch (`Marks`), not a lock.
"""

from __future__ import annotations

import contextlib
import mmap
import os

from kvd_proto.barrier import fence
from kvd_proto.below_layout import BelowHeader
from kvd_proto.index_layout import (
    MARKS_BYTES,
    RECLAIM_EPOCH_OFFSET,
    RESET_EPOCH_OFFSET,
    STATE_FREE,
    STATE_READY,
    STATE_STORING,
    Header,
)

__all__ = ["STATE_FREE", "STATE_READY", "STATE_STORING", "BelowMap", "IndexReader", "Marks"]


class IndexReader:
    """A read-only mapping of one namespace's index (owns the descriptor): its header, for
    `Lookups.bind`, and the reset and reclaim epochs the daemon publishes in it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        self.header = h = Header.unpack(self._map[:64])
        if h.file_bytes > size:
            raise ValueError(f"index file of {size} bytes is smaller than its layout says")
        self._epochs = memoryview(self._map)[RESET_EPOCH_OFFSET:RECLAIM_EPOCH_OFFSET + 8] \
            .cast("Q")

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

    def close(self) -> None:
        self._epochs.release()
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
