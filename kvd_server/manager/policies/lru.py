"""LRU with request-scoped recency (vLLM 0.33's heap LRU semantics) over slot-indexed arrays.

A block's rank is `(request_rank, -token_position)` packed into one int64 per slot: all blocks
of an active request share one provisional rank, so a request's tail is evicted before its
head; blocks ranked without a position get a fresh global rank. When a request finishes its
blocks get fresh increasing ranks tail -> head (head newest). Ties break by key, as vLLM's heap
of `(rank, key)` does.

vLLM keeps every evictable block in a heap. Here only the *front* is a heap: the evictable
blocks ranked at or below a `threshold`, chosen from the rank array in one vectorised pass
(`_refill`) whenever the front runs dry. A block that becomes evictable, or is re-ranked, at or
below the threshold is pushed onto the front; one above it waits in the array until a later
refill reaches it. So the front always holds every evictable block ranked <= threshold, and
its minimum is the minimum over all evictable blocks: the same victims as vLLM's heap, with a
Python object only for the few thousand blocks at the front.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvd_server.policy_names import LRU

from ..blocks import READY, BlockTable
from .base import Policy, RequestState, order_request_keys

POSITION_BITS = 24                       # a rank packs (order, position) into one int64
_POS = 1 << POSITION_BITS
MAX_ORDER = (1 << (63 - POSITION_BITS)) - 1
FRONT = 4096                             # blocks a refill puts at the front (at least)
# A front entry is one int, `rank << SLOT_BITS | slot`: ordered as (rank, slot), compared and
# freed several times faster than a tuple (an eviction pops a few entries per block).
SLOT_BITS = 32
_SLOT_MASK = (1 << SLOT_BITS) - 1
_NO_THRESHOLD = -1
_ALL = (1 << 63) - 1


def _rank(order: int, position: int = 0) -> int:
    """Ascending like (order, -position): a request's tail sorts before its head."""
    return order * _POS + (_POS - 1 - min(max(position, 0), _POS - 1))


class LRUPolicy(Policy):
    name = LRU

    def __init__(self, capacity: int, table: BlockTable, ranks: Any = None) -> None:
        """`ranks`: a buffer of table.capacity int64 that outlives the daemon (warm restart),
        read by `adopt`; None: zeros of its own."""
        super().__init__(capacity, table)
        self.persisted = ranks is not None
        self.rank_array = np.zeros(table.capacity, dtype=np.int64) if ranks is None else \
            np.frombuffer(ranks, dtype=np.int64, count=table.capacity)
        self.ranks = memoryview(self.rank_array)
        # rank << SLOT_BITS | slot, a min-heap: an entry is current while its slot is READY
        # at that rank (a block that took a freed slot at the very same rank is the same
        # victim to LRU). The key is read when a block is picked, not kept per entry.
        if table.capacity > _SLOT_MASK:
            raise ValueError(f"{table.capacity} slots: LRU's front takes at most {_SLOT_MASK}")
        self._front: list[int] = []
        self._threshold = _NO_THRESHOLD
        self._next_rank = 0
        self._generation = 0
        self.max_order = MAX_ORDER
        self.front_size = FRONT
        self.renumbered = 0

    # -- ranks --
    def _new_order(self) -> int:
        if self._next_rank >= self.max_order:
            self._renumber()
        self._next_rank += 1
        return self._next_rank

    def _request_rank(self, req: RequestState) -> int:
        if req.lru_generation != self._generation:
            req.lru_rank = self._new_order()
            req.lru_generation = self._generation
        return req.lru_rank

    def _renumber(self) -> None:
        """Orders ran out of bits (after ~5e11 rank updates): map every order in use to
        1..k, keeping their order, so ranks stay comparable exactly as before."""
        resident = self.table.resident()
        orders = self.rank_array[resident] >> POSITION_BITS
        open_reqs = [r for r in self.open_requests if r.lru_generation == self._generation]
        used = np.unique(np.concatenate([orders, np.array([r.lru_rank for r in open_reqs],
                                                          dtype=np.int64)]))
        renumbered = np.searchsorted(used, orders).astype(np.int64) + 1
        self.rank_array[resident] = (renumbered << POSITION_BITS) | (
            self.rank_array[resident] & (_POS - 1))
        for req in open_reqs:
            req.lru_rank = int(np.searchsorted(used, req.lru_rank)) + 1
        self._next_rank = len(used)
        self.renumbered += 1
        self._front.clear()
        self._threshold = _NO_THRESHOLD
        if self._next_rank >= self.max_order:
            raise RuntimeError("LRU ranks exhausted: more orders in use than rank bits allow")

    def _push(self, slot: int) -> None:
        """`slot` became evictable or was re-ranked: onto the front if it belongs there."""
        rank = self.ranks[slot]
        if rank <= self._threshold:
            heapq.heappush(self._front, rank << SLOT_BITS | slot)
            if len(self._front) > 4 * self.front_size:
                self._refill(self.front_size)

    def _renew(self, keys: Iterable[bytes]) -> None:
        """Fresh, increasing ranks for `keys` in order (each its own order, position 0)."""
        find, ranks, state = self.table.find, self.ranks, self.table.state
        threshold = self._threshold
        for key in keys:
            slot = find(key)
            if slot < 0:
                continue
            if self._next_rank >= self.max_order:
                self._renumber()
                threshold = self._threshold
            self._next_rank += 1
            rank = ranks[slot] = self._next_rank * _POS + _POS - 1      # _rank(order)
            if state[slot] == READY and rank <= threshold:
                self._push(slot)
                threshold = self._threshold                  # a refill may have moved it

    # -- hooks --
    def insert(self, key: bytes, slot: int, req: RequestState) -> None:
        self.insert_many((key,), (slot,), req)

    def insert_many(self, keys: Sequence[bytes], slots: Sequence[int],
                    req: RequestState) -> None:
        """`insert` of each (key, slot) in order (a store's new blocks)."""
        positions, ranks = req.positions, self.ranks
        top = _POS - 1
        base = None
        for key, slot in zip(keys, slots, strict=True):
            position = positions.get(key)
            if position is None:
                ranks[slot] = self._new_order() * _POS + top          # _rank(order)
            else:
                if base is None:
                    base = self._request_rank(req) * _POS + top
                ranks[slot] = base - min(max(position, 0), top)      # _rank(order, position)

    def moved(self, old: int, new: int) -> None:
        self.ranks[new] = self.ranks[old]

    def touch(self, keys: Iterable[bytes], req: RequestState) -> None:
        self._renew(reversed(list(keys)))

    def on_request_access(self, keys: Sequence[bytes], req: RequestState,
                          slots: Sequence[int] | None = None) -> None:
        base = self._request_rank(req) * _POS + _POS - 1
        find, ranks, state = self.table.find, self.ranks, self.table.state
        positions = req.positions
        threshold = self._threshold
        top = _POS - 1
        for i, key in enumerate(keys):
            position = positions.get(key)
            if position is None:
                continue
            slot = find(key) if slots is None else slots[i]
            if slot < 0:
                continue
            rank = base - (position if 0 <= position < top else (top if position > 0 else 0))
            if ranks[slot] >= rank:
                continue
            ranks[slot] = rank
            if state[slot] == READY and rank <= threshold:
                self._push(slot)
                threshold = self._threshold                  # a refill may have moved it

    def on_request_finished(self, key_groups: Sequence[Sequence[bytes]],
                            insertion_only: set[bytes], reused: set[bytes],
                            req: RequestState) -> None:
        self._renew(reversed(order_request_keys(key_groups, req)))

    def mark_evictable(self, slot: int) -> None:
        if self.ranks[slot] <= self._threshold:     # `_push`'s test first: most are above
            self._push(slot)

    def mark_evictable_many(self, slots: Sequence[int]) -> None:
        ranks, threshold = self.ranks, self._threshold
        for slot in slots:
            if ranks[slot] <= threshold:
                self._push(slot)
                threshold = self._threshold                  # a refill may have moved it

    def adopt(self, slots: np.ndarray) -> None:
        """With ranks that outlived the previous daemon, its order carries on: adopted blocks
        keep their ranks, the next rank follows the highest; blocks with no rank (or none
        kept) rank oldest first in slot order."""
        kept = self.rank_array[slots] if self.persisted else np.zeros(0, dtype=np.int64)
        if len(kept) and len(slots):
            orders = kept >> POSITION_BITS
            self._next_rank = max(self._next_rank, int(orders.max()))
            slots = slots[kept <= 0]                     # never ranked: fresh ranks below
        n = len(slots)
        if n + self._next_rank >= self.max_order:
            self._renumber()
        if n:
            orders = np.arange(self._next_rank + 1, self._next_rank + n + 1, dtype=np.int64)
            self.rank_array[slots] = orders * _POS + (_POS - 1)      # _rank(order)
            self._next_rank += n
        self._front.clear()
        self._threshold = _NO_THRESHOLD       # the next eviction refills the front

    def clear(self) -> None:
        self._front.clear()
        self._threshold = _NO_THRESHOLD
        self._next_rank = 0
        self._generation += 1

    # -- eviction --
    def _refill(self, want: int) -> None:
        """Rebuild the front from the arrays: every evictable block ranked at or below the
        `want`-th smallest evictable rank (ties included)."""
        evictable = np.flatnonzero(self.table.state_array == READY)
        ranks = self.rank_array[evictable]
        if len(evictable) > want:
            threshold = int(np.partition(ranks, want - 1)[want - 1])
            chosen = ranks <= threshold
            evictable, ranks = evictable[chosen], ranks[chosen]
        else:
            threshold = _ALL        # every evictable block is at the front
        self._front = [rank << SLOT_BITS | slot
                       for rank, slot in zip(ranks.tolist(), evictable.tolist(), strict=True)]
        heapq.heapify(self._front)
        self._threshold = threshold

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, int]] | None:
        if n == 0:
            return []
        chosen = self._pick(n, protected)
        if chosen is None:
            # The front ran dry (or holds only protected blocks): refill it deep enough for
            # this eviction and pick again, from the same state.
            self._refill(max(self.front_size, n + len(protected)))
            chosen = self._pick(n, protected)
            if chosen is None:
                return None
        return chosen

    def _pick(self, n: int, protected: set[bytes]) -> list[tuple[bytes, int]] | None:
        """Pop the n smallest current, unprotected entries: their (key, slot); on failure put
        every popped current entry back (nothing changed) and return None."""
        front = self._front
        chosen: list[tuple[bytes, int]] = []
        picked: list[int] = []
        deferred: list[int] = []
        # An entry is current while its slot is READY at its rank (an eviction pops a few
        # entries per block, stale ones included). A block pushed twice at one rank is one
        # int twice: the copies pop one after the other, the second is skipped.
        pop, state, ranks, key_of = heapq.heappop, self.table.state, self.ranks, \
            self.table.key_of
        last = -1
        left = n
        while left and front:
            entry = pop(front)
            if entry == last:
                continue
            last = entry
            slot = entry & _SLOT_MASK
            if state[slot] != READY or ranks[slot] != entry >> SLOT_BITS:
                continue  # stale: re-ranked, pinned or gone
            key = key_of(slot)
            if key in protected:
                deferred.append(entry)
                continue
            chosen.append((key, slot))
            picked.append(entry)
            left -= 1
        for entry in deferred:
            heapq.heappush(front, entry)
        if len(chosen) < n:
            for entry in picked:
                heapq.heappush(front, entry)
            return None
        return chosen
