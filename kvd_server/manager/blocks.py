"""A namespace's resident blocks in preallocated per-slot arrays, keyed through the shared index.

No Python object per block (so no per-block allocation, nothing for the garbage collector to
walk): a block is its slot id, its state is one int32 in `state`, its key lives only in the
namespace's shared index (kvd_server/memory/shm_index.py), the same arrays engines read. The arrays
are zero-filled by the kernel on first touch, so a namespace pays only for the slots it uses.

`state[slot]`: ABSENT (0) no block, STORING (1) reserved and being written, READY (2) readable
and unpinned, READY + n readable and pinned by n loads or leases.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvd_server.memory.shm_index import ShmIndex

ABSENT = 0
STORING = 1
READY = 2
MAX_PINS = (1 << 31) - 1 - READY


class BlockTable:
    """key -> slot (the shared index; `_spill` for the rare key it cannot hold) and per-slot
    state. The manager is its only writer; what it publishes engines see at once."""

    __slots__ = ("index", "capacity", "state", "state_array", "count", "_spill", "_spill_keys",
                 "find", "key_of", "_ready", "_insert", "_remove")

    def __init__(self, index: ShmIndex, capacity: int) -> None:
        self.index = index
        self.capacity = capacity
        self.state_array = np.zeros(capacity, dtype=np.int32)
        # Item access through a memoryview returns plain ints, several times faster than numpy's.
        self.state = memoryview(self.state_array)
        self.count = 0
        # Keys the index cannot publish (longer than its key width, or no bucket within its
        # probe limit): kept here so the manager still knows them; engines never see them.
        self._spill: dict[bytes, int] = {}
        self._spill_keys: dict[int, bytes] = {}
        # find(key) -> the slot of `key`'s resident block, or -1: the index's own probe (one
        # C call where built) while no key spilled; `_find_spilled` once one has.
        self.find = index.find_function()
        # key_of(slot) -> the key of the block in `slot` (b"" when none): likewise the index's
        # own call while no key spilled, `_key_of_spilled` once one has.
        self.key_of = index.key_of_function()
        self._ready = index.set_ready_function()
        self._insert = index.insert_function()
        self._remove = index.remove_function()

    def __len__(self) -> int:
        return self.count

    def _find_spilled(self, key: bytes) -> int:
        slot = self.index.find(key)
        if slot < 0:
            return self._spill.get(key, -1)
        return slot

    def _key_of_spilled(self, slot: int) -> bytes:
        key = self._spill_keys.get(slot)
        return self.index.key_of(slot) if key is None else key

    def classify(self, keys: Sequence[bytes]
                 ) -> tuple[list[bytes], list[bytes], dict[bytes, int]]:
        """Of `keys` (an offer): those with no block, those readable (ready or pinned), and
        each key's slot (-1: none)."""
        absent: list[bytes] = []
        readable: list[bytes] = []
        find, state = self.find, self.state
        slot_of = {}
        for key in keys:
            slot_of[key] = slot = find(key)
            if slot < 0:
                absent.append(key)
            elif state[slot] != STORING:
                readable.append(key)
        return absent, readable, slot_of

    def add(self, key: bytes, slot: int) -> None:
        """A new block of `key` being stored in `slot` (published as STORING)."""
        if not self.index.insert(slot, key):
            self._spill[key] = slot
            self._spill_keys[slot] = key
            self.find = self._find_spilled
            self.key_of = self._key_of_spilled
        self.state[slot] = STORING
        self.count += 1

    def add_many(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """`add` of each (key, slot) in order (a store's new blocks, in one call)."""
        insert, state = self._insert, self.state
        for key, slot in zip(keys, slots, strict=True):
            if insert(slot, key):
                state[slot] = STORING
                self.count += 1
            else:
                self.add(key, slot)

    def set_ready(self, slot: int) -> None:
        self.state[slot] = READY
        self._ready(slot)

    def drop(self, slot: int) -> None:
        """The block in `slot` is gone (unpublished; the slot itself is the caller's)."""
        if self._spill_keys:
            key = self._spill_keys.pop(slot, None)
            if key is not None:
                del self._spill[key]
                if not self._spill:
                    self.find = self.index.find_function()
                    self.key_of = self.index.key_of_function()
        self.index.remove(slot)
        self.state[slot] = ABSENT
        self.count -= 1

    def drop_many(self, slots: Sequence[int]) -> None:
        """`drop` of each slot (an eviction's victims, in one call)."""
        if self._spill_keys:
            for slot in slots:
                self.drop(slot)
            return
        remove, state = self._remove, self.state
        for slot in slots:
            remove(slot)
            state[slot] = ABSENT
        self.count -= len(slots)

    def move(self, key: bytes, old: int, new: int) -> None:
        """`key`'s block now lives in `new` (a duplicate store completed first), keeping its
        state; `old` is no longer the block's."""
        state = self.state[old]
        self.drop(old)
        self.add(key, new)
        self.state[new] = state
        if state >= READY:
            self.index.set_ready(new)

    def adopt(self, ready: np.ndarray) -> None:
        """Blocks the index already shows READY in `ready` (a warm restart's checked slots):
        readable and unpinned, as they were."""
        self.state_array[ready] = READY
        self.count += len(ready)

    def resident(self) -> np.ndarray:
        """Every slot holding a block (a copy, ascending)."""
        return np.flatnonzero(self.state_array)

    def clear(self) -> None:
        self.index.clear()
        self.state_array[np.flatnonzero(self.state_array)] = ABSENT   # only touched pages
        self._spill.clear()
        self._spill_keys.clear()
        self.find = self.index.find_function()
        self.key_of = self.index.key_of_function()
        self.count = 0
