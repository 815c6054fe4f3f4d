"""ARC: adaptive replacement between recency (T1) and frequency (T2), vLLM 0.33 semantics,
over slot-indexed arrays.

T1 holds blocks used once, T2 blocks reused by a request; B1/B2 remember recently evicted keys.
A store miss on a B1 ghost grows the T1 target, on a B2 ghost shrinks it. Eviction takes T1's
oldest evictable block while |T1| >= target, else T2's, falling back to the other list, and is
all-or-nothing.

T1 and T2 are doubly linked lists threaded through two int32 arrays indexed by slot (a node
per slot, two sentinels after the last slot), so moving a block costs a few array writes and
no object. The ghost lists hold keys of blocks no longer resident (bounded by the capacity).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from kvd_server.policy_names import ARC

from ..blocks import READY, STORING, BlockTable
from .base import Policy, RequestState, order_request_keys

_NONE, _T1, _T2 = 0, 1, 2


class ARCPolicy(Policy):
    name = ARC

    def __init__(self, capacity: int, table: BlockTable) -> None:
        super().__init__(capacity, table)
        self.target_t1_size = 0.0
        n = table.capacity
        self._head = (0, n, n + 1)              # sentinel node of T1 and of T2
        self._prev_array = np.zeros(n + 2, dtype=np.int32)
        self._next_array = np.zeros(n + 2, dtype=np.int32)
        self._list_array = np.zeros(n, dtype=np.int8)
        self._prev, self._next = memoryview(self._prev_array), memoryview(self._next_array)
        self._list = memoryview(self._list_array)
        # The list a retained block left (`hold`): it goes back to that list's end when let go,
        # so the scans never pass over retained blocks.
        self._held_array = np.zeros(n, dtype=np.int8)
        self._held = memoryview(self._held_array)
        self._size = [0, 0, 0]
        for head in self._head[1:]:
            self._prev[head] = self._next[head] = head
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    # -- the two lists --
    def _append(self, which: int, slot: int) -> None:
        head = self._head[which]
        last = self._prev[head]
        self._next[last] = slot
        self._prev[slot] = last
        self._next[slot] = head
        self._prev[head] = slot
        self._list[slot] = which
        self._size[which] += 1

    def _unlink(self, slot: int) -> int:
        which = self._list[slot]
        if which:
            prev, nxt = self._prev[slot], self._next[slot]
            self._next[prev] = nxt
            self._prev[nxt] = prev
            self._list[slot] = _NONE
            self._size[which] -= 1
        return which

    def _slots(self, which: int) -> Iterator[int]:
        head = self._head[which]
        slot = self._next[head]
        while slot != head:
            nxt = self._next[slot]      # read first: the caller may move `slot`
            yield slot
            slot = nxt

    @property
    def t1(self) -> list[bytes]:
        """T1's keys, oldest first."""
        return [self.table.key_of(s) for s in self._slots(_T1)]

    @property
    def t2(self) -> list[bytes]:
        """T2's keys, oldest first."""
        return [self.table.key_of(s) for s in self._slots(_T2)]

    # -- hooks --
    def insert(self, key: bytes, slot: int, req: RequestState) -> None:
        self.insert_many((key,), (slot,), req)

    def insert_many(self, keys: Sequence[bytes], slots: Sequence[int],
                    req: RequestState) -> None:
        """`insert` of each (key, slot) in order, linked at T1's end in one pass."""
        prev, nxt, lists, head = self._prev, self._next, self._list, self._head[_T1]
        last = prev[head]
        for slot in slots:
            nxt[last] = slot
            prev[slot] = last
            lists[slot] = _T1
            last = slot
        nxt[last] = head
        prev[head] = last
        self._size[_T1] += len(slots)
        b1, b2 = self.b1, self.b2
        if b1 or b2:
            for key in keys:
                b1.pop(key, None)
                b2.pop(key, None)

    def mark_evictable_many(self, slots: Sequence[int]) -> None:
        """Nothing to do: a block's place in T1/T2 does not change when it becomes evictable
        (eviction skips blocks that are not READY)."""

    def remove(self, slot: int) -> None:
        self._unlink(slot)
        self._held[slot] = _NONE

    def hold(self, slot: int) -> None:
        """Retained: out of its list (the scans skip it anyway) until `unhold`."""
        self._held[slot] = self._unlink(slot)

    def unhold(self, slot: int) -> None:
        """Back at the end of the list it left: retained, it was as good as used."""
        which = self._held[slot]
        if which:
            self._held[slot] = _NONE
            self._append(which, slot)

    def moved(self, old: int, new: int) -> None:
        """The block in `old` now lives in `new`: `new` takes its place in its list."""
        which = self._list[old]
        if not which:
            return
        prev, nxt = self._prev[old], self._next[old]
        self._next[prev] = new
        self._prev[nxt] = new
        self._prev[new], self._next[new] = prev, nxt
        self._list[new] = which
        self._list[old] = _NONE

    def _ghost_hit(self, key: bytes) -> bool:
        if key in self.b1:
            delta = max(1, len(self.b2) / len(self.b1))
            self.target_t1_size = min(self.target_t1_size + delta, self.capacity)
            self.b1.move_to_end(key)
            return True
        if key in self.b2:
            delta = max(1, len(self.b1) / len(self.b2))
            self.target_t1_size = max(self.target_t1_size - delta, 0)
            self.b2.move_to_end(key)
            return True
        return False

    def on_store_miss(self, keys: Iterable[bytes], req: RequestState) -> None:
        b1, b2 = self.b1, self.b2
        for key in reversed(list(keys)):
            if key in b1 or key in b2:          # `_ghost_hit` changes nothing otherwise
                self._ghost_hit(key)

    def touch(self, keys: Iterable[bytes], req: RequestState) -> None:
        table, state = self.table, self.table.state
        for key in reversed(list(keys)):
            slot = table.find(key)
            if slot < 0:
                self._ghost_hit(key)
                continue
            which = self._unlink(slot)
            if which == _T1 and state[slot] == STORING:
                self._append(_T1, slot)   # only just reserved for a store: not a second use
            elif which:
                self._append(_T2, slot)

    def on_request_finished(self, key_groups: Sequence[Sequence[bytes]],
                            insertion_only: set[bytes], reused: set[bytes],
                            req: RequestState) -> None:
        # Each block moves to the end of its list (stored only: storing is not a frequency
        # hit, recency refreshed) or of T2 (reused): `_unlink` then `_append`, inline.
        find = self.table.find
        prev, nxt, lists, size, heads = self._prev, self._next, self._list, self._size, \
            self._head
        for key in reversed(order_request_keys(key_groups, req)):
            if key in insertion_only:
                to = _NONE                       # the list it is in
            elif key in reused:
                to = _T2
            else:
                continue
            slot = find(key)
            if slot < 0:
                continue
            which = lists[slot]
            if not which:
                continue
            before, after = prev[slot], nxt[slot]
            nxt[before] = after
            prev[after] = before
            if to == _NONE:
                to = which
            elif to != which:
                size[which] -= 1
                size[to] += 1
                lists[slot] = to
            head = heads[to]
            last = prev[head]
            nxt[last] = slot
            prev[slot] = last
            nxt[slot] = head
            prev[head] = slot

    def adopt(self, slots: np.ndarray) -> None:
        """Into T1 (used once, as far as this daemon knows), in order, linked in one pass."""
        n = len(slots)
        if not n:
            return
        head = self._head[_T1]
        last = self._prev[head]
        chain = np.concatenate(([last], slots.astype(np.int32), [head])).astype(np.int32)
        self._next_array[chain[:-1]] = chain[1:]
        self._prev_array[chain[1:]] = chain[:-1]
        self._list_array[slots] = _T1
        self._size[_T1] += n

    def clear(self) -> None:
        self._list_array[np.flatnonzero(self._list_array)] = _NONE
        self._held_array[np.flatnonzero(self._held_array)] = _NONE
        for which in (_T1, _T2):
            head = self._head[which]
            self._prev[head] = self._next[head] = head
            self._size[which] = 0
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = 0.0

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, int]] | None:
        if n == 0:
            return []
        state, key_of, nxt = self.table.state, self.table.key_of, self._next

        def scan(cursor: int, head: int) -> tuple[bytes, int, int]:
            """The first READY, unprotected block from `cursor` on: (key, slot, the cursor
            past it); (b"", -1, head) when the list has none left."""
            while cursor != head:
                slot, cursor = cursor, nxt[cursor]
                if state[slot] == READY:
                    key = key_of(slot)
                    if key not in protected:
                        return key, slot, cursor
            return b"", -1, head

        # Scans only move forward (a cursor per list), so a batch eviction stays linear.
        h1, h2 = self._head[_T1], self._head[_T2]
        c1, c2 = nxt[h1], nxt[h2]
        t1_size = self._size[_T1]
        target = int(self.target_t1_size)
        chosen: list[tuple[bytes, int, bool]] = []
        for _ in range(n):
            slot = -1
            if t1_size >= target:
                key, slot, c1 = scan(c1, h1)
                from_t1 = True
            if slot < 0:
                key, slot, c2 = scan(c2, h2)
                from_t1 = False
            if slot < 0:
                key, slot, c1 = scan(c1, h1)
                from_t1 = True
                if slot < 0:
                    return None
            t1_size -= from_t1
            chosen.append((key, slot, from_t1))
        victims = []
        for key, slot, from_t1 in chosen:
            self._unlink(slot)
            (self.b1 if from_t1 else self.b2)[key] = None
            victims.append((key, slot))
        for ghosts in (self.b1, self.b2):
            for _ in range(len(ghosts) - self.capacity):
                ghosts.popitem(last=False)
        return victims
