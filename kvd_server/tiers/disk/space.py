"""Where the disk tier's blocks lie in its data file, and which to drop for room.

The data file is cut into extents of `extent_bytes`; an extent in use holds slots of one size
(a block's length rounded up to `ALIGN`, the direct-I/O unit), so namespaces of different block
sizes share the file without fragmenting it. Allocation takes a free slot of the size, else a
free extent, else evicts: the least recently used block of the same size, or, when that size
has no block to give, every block of the extent that holds the least recently used block
overall. A tenant over its quota gives its own least recently used blocks first. Blocks being
written or read are never evicted. Pure bookkeeping: no I/O, no locks (the tier holds its lock).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvd_server.tiers.base import TierKey

ALIGN = 4096
MAX_EVICTION_SCAN = 4096        # LRU entries looked at per allocation, at most


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class State(enum.Enum):
    WRITING = "writing"
    READY = "ready"


@dataclass(slots=True)
class Entry:
    key: TierKey
    offset: int
    length: int
    alloc: int
    crc: int = 0
    state: State = State.WRITING
    readers: int = 0
    dropped: bool = False           # removed while being read: freed when the last read ends


@dataclass(slots=True)
class _Extent:
    alloc: int                      # slot bytes (0: free extent)
    free: list[int] = field(default_factory=list)
    used: int = 0


class DiskSpace:
    """Slots, LRU order and per-tenant bytes of one disk tier (see the module doc)."""

    def __init__(self, data_bytes: int, extent_bytes: int,
                 quota_of: Callable[[str], int] | None = None) -> None:
        if extent_bytes < ALIGN or extent_bytes % ALIGN:
            raise ValueError(f"extent size {extent_bytes} is not a multiple of {ALIGN}")
        self.extent_bytes = extent_bytes
        self.count = data_bytes // extent_bytes
        self.capacity_bytes = self.count * extent_bytes
        self.extents: dict[int, _Extent] = {}           # extents in use, by number
        self._fresh = 0                                 # extents never used: this and on
        self._free_extents: list[int] = []              # extents given back
        self._open: dict[int, set[int]] = {}     # slot bytes -> extents with a free slot
        self.entries: dict[int, Entry] = {}             # offset -> entry
        self.by_key: dict[TierKey, Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()   # READY offsets, oldest first
        self.tenant_bytes: dict[str, int] = {}
        self._quota_of = quota_of or (lambda tenant: 0)
        self.used_bytes = 0

    # ------------------------------------------------------------------ queries
    def get(self, key: TierKey) -> Entry | None:
        return self.by_key.get(key)

    def touch(self, entry: Entry) -> None:
        if entry.offset in self._lru:
            self._lru.move_to_end(entry.offset)

    # --------------------------------------------------------------- allocation
    def allocate(self, key: TierKey, length: int) -> tuple[Entry | None, list[Entry]]:
        """A slot for `key`'s block of `length` bytes, as a WRITING entry: (the entry or None
        when no room can be made, the entries evicted for it)."""
        alloc = aligned(length)
        if alloc > self.extent_bytes or not length:
            return None, []
        evicted: list[Entry] = []
        quota = self._quota_of(key.tenant)
        if quota:
            if alloc > quota:
                return None, []
            while self.tenant_bytes.get(key.tenant, 0) + alloc > quota:
                victim = self._oldest(lambda e: e.key.tenant == key.tenant)
                if victim is None:
                    return None, evicted
                evicted.append(self._evict(victim))
        offset = self._take(alloc)
        if offset is None:
            victim = self._oldest(lambda e: e.alloc == alloc)
            if victim is not None:
                evicted.append(self._evict(victim))
                offset = self._take(alloc)
            else:
                evicted.extend(self._free_extent_of_oldest())
                offset = self._take(alloc)
        if offset is None:
            return None, evicted
        entry = Entry(key, offset, length, alloc)
        self.entries[offset] = entry
        self.by_key[key] = entry
        self._account(entry, +1)
        return entry, evicted

    def _take(self, alloc: int) -> int | None:
        open_ = self._open.get(alloc)
        if open_:
            i = next(iter(open_))
        elif self._free_extents or self._fresh < self.count:
            if self._free_extents:
                i = self._free_extents.pop()
            else:
                i, self._fresh = self._fresh, self._fresh + 1
            self._format(i, alloc)
        else:
            return None
        return self._take_from(i)

    def _format(self, i: int, alloc: int) -> None:
        """Give free extent `i` slots of `alloc` bytes."""
        ext = self.extents[i] = _Extent(alloc)
        base = i * self.extent_bytes
        ext.free = [base + k * alloc for k in range(self.extent_bytes // alloc - 1, -1, -1)]
        ext.used = 0
        self._open.setdefault(alloc, set()).add(i)

    def _claim(self, i: int) -> None:
        """Take free extent `i` out of the free ones (adopting what the journal says)."""
        while self._fresh <= i:
            self._free_extents.append(self._fresh)
            self._fresh += 1
        self._free_extents.remove(i)

    def _take_from(self, i: int, offset: int | None = None) -> int:
        ext = self.extents[i]
        if offset is None:
            offset = ext.free.pop()
        else:
            ext.free.remove(offset)
        ext.used += 1
        if not ext.free:
            self._open[ext.alloc].discard(i)
        return offset

    def _oldest(self, match: Callable[[Entry], bool]) -> Entry | None:
        """The least recently used evictable READY entry that `match`es (bounded scan)."""
        for n, offset in enumerate(self._lru):
            if n >= MAX_EVICTION_SCAN:
                return None
            entry = self.entries[offset]
            if entry.readers == 0 and match(entry):
                return entry
        return None

    def _free_extent_of_oldest(self) -> list[Entry]:
        """Evict every block of the extent holding the oldest evictable block, if all of them
        may go; the entries evicted."""
        for n, offset in enumerate(self._lru):
            if n >= MAX_EVICTION_SCAN:
                break
            i = offset // self.extent_bytes
            base, alloc = i * self.extent_bytes, self.extents[i].alloc
            members = [e for e in map(self.entries.get,
                                      range(base, base + self.extent_bytes - alloc + 1, alloc))
                       if e is not None]
            if all(e.state is State.READY and e.readers == 0 for e in members):
                return [self._evict(e) for e in members]
        return []

    def _evict(self, entry: Entry) -> Entry:
        self.release(entry)
        return entry

    # ------------------------------------------------------------------ changes
    def ready(self, entry: Entry, crc: int) -> None:
        entry.crc = crc
        entry.state = State.READY
        self._lru[entry.offset] = None

    def adopt(self, key: TierKey, offset: int, length: int, alloc: int, crc: int) -> bool:
        """A block the journal recorded, at start: place it where it lies (False when it
        cannot be: outside the file, a clash with another block or the extent's size)."""
        i, within = divmod(offset, self.extent_bytes)
        if (i >= self.count or alloc != aligned(length) or within % alloc
                or within + alloc > self.extent_bytes or key in self.by_key
                or offset in self.entries):
            return False
        ext = self.extents.get(i)
        if ext is None:
            self._claim(i)
            self._format(i, alloc)
        elif ext.alloc != alloc:
            return False
        self._take_from(i, offset)
        entry = Entry(key, offset, length, alloc)
        self.entries[offset] = entry
        self.by_key[key] = entry
        self._account(entry, +1)
        self.ready(entry, crc)
        return True

    def release(self, entry: Entry) -> None:
        """Forget `entry` and free its slot (its extent too when it was the last)."""
        if self.entries.get(entry.offset) is not entry:
            return
        del self.entries[entry.offset]
        if self.by_key.get(entry.key) is entry:
            del self.by_key[entry.key]
        self._lru.pop(entry.offset, None)
        self._account(entry, -1)
        i = entry.offset // self.extent_bytes
        ext = self.extents[i]
        ext.free.append(entry.offset)
        ext.used -= 1
        if ext.used == 0:
            self._open[ext.alloc].discard(i)
            del self.extents[i]
            self._free_extents.append(i)
        else:
            self._open[ext.alloc].add(i)

    def _account(self, entry: Entry, sign: int) -> None:
        self.used_bytes += sign * entry.alloc
        tenant = entry.key.tenant
        left = self.tenant_bytes.get(tenant, 0) + sign * entry.alloc
        if left:
            self.tenant_bytes[tenant] = left
        else:
            self.tenant_bytes.pop(tenant, None)
