"""LRU with request-scoped recency (vLLM 0.33's heap LRU semantics).

Evictable blocks sit in a lazily invalidated min-heap ordered by rank `(request_rank,
-token_position)`: all blocks of an active request share one provisional rank, so a request's
tail is evicted before its head; blocks inserted without a position get a fresh global rank.
When a request finishes its blocks get fresh increasing ranks tail -> head (head newest).
Stale heap entries are skipped on pop and compacted away when the heap grows too large.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from .base import Block, Policy, RequestState, order_request_keys

Rank = int
_POS = 1 << 32   # a rank packs (request_rank, -position) into one int: fewer objects per block


def _rank(order: int, position: int = 0) -> int:
    """Ascending like (order, -position): a request's tail sorts before its head."""
    return order * _POS + (_POS - 1 - min(position, _POS - 1))


class LRUPolicy(Policy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.blocks: dict[bytes, Block] = {}
        self._evictable: set[bytes] = set()
        self._heap: list[tuple[Rank, bytes]] = []
        self._next_rank = 0
        self._generation = 0

    # -- index --
    def get(self, key: bytes) -> Block | None:
        return self.blocks.get(key)

    def __len__(self) -> int:
        return len(self.blocks)

    def items(self) -> Iterable[tuple[bytes, Block]]:
        return self.blocks.items()

    # -- ranks --
    def _request_rank(self, req: RequestState) -> int:
        if req.lru_generation != self._generation:
            self._next_rank += 1
            req.lru_rank = self._next_rank
            req.lru_generation = self._generation
        return req.lru_rank

    def _fresh_rank(self, key: bytes) -> bool:
        block = self.blocks.get(key)
        if block is None:
            return False
        self._next_rank += 1
        block.rank = _rank(self._next_rank)
        return key in self._evictable

    def _rebuild(self) -> None:
        blocks = self.blocks
        self._heap = [(blocks[k].rank, k) for k in self._evictable]
        heapq.heapify(self._heap)

    def _maybe_compact(self) -> None:
        if len(self._heap) >= max(64, 2 * len(self._evictable)):
            self._rebuild()

    def _requeue(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        # A long prefix is cheaper to heapify than to push one by one.
        if len(keys) >= max(64, len(self._evictable) // 4):
            self._rebuild()
            return
        blocks = self.blocks
        for key in keys:
            heapq.heappush(self._heap, (blocks[key].rank, key))
        self._maybe_compact()

    def _renew(self, keys: Iterable[bytes]) -> None:
        self._requeue([key for key in keys if self._fresh_rank(key)])

    # -- hooks --
    def insert(self, key: bytes, block: Block, req: RequestState) -> None:
        self.blocks[key] = block
        position = req.position(key)
        if position is None:
            self._next_rank += 1
            block.rank = _rank(self._next_rank)
        else:
            block.rank = _rank(self._request_rank(req), position)
        if block.ref == 0:
            self._evictable.add(key)
            heapq.heappush(self._heap, (block.rank, key))

    def remove(self, key: bytes) -> None:
        del self.blocks[key]
        self._evictable.discard(key)

    def touch(self, keys: Iterable[bytes], req: RequestState) -> None:
        self._renew(reversed(list(keys)))

    def on_request_access(self, keys: Iterable[bytes], req: RequestState) -> None:
        request_rank = self._request_rank(req)
        moved = []
        for key in keys:
            position = req.position(key)
            block = self.blocks.get(key)
            if position is None or block is None:
                continue
            rank = _rank(request_rank, position)
            if block.rank >= rank:
                continue
            block.rank = rank
            if key in self._evictable:
                moved.append(key)
        self._requeue(moved)

    def on_request_finished(self, key_groups: Sequence[Sequence[bytes]],
                            insertion_only: set[bytes], reused: set[bytes],
                            req: RequestState) -> None:
        self._renew(reversed(order_request_keys(key_groups, req)))

    def clear(self) -> None:
        self.blocks.clear()
        self._evictable.clear()
        self._heap.clear()
        self._next_rank = 0
        self._generation += 1

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Block]] | None:
        if n == 0:
            return []
        heap = self._heap
        blocks = self.blocks
        evictable = self._evictable
        chosen: list[tuple[Rank, bytes]] = []
        chosen_keys: set[bytes] = set()
        deferred: list[tuple[Rank, bytes]] = []
        while heap and len(chosen) < n:
            entry = heapq.heappop(heap)
            rank, key = entry
            if key not in evictable or blocks[key].rank != rank or key in chosen_keys:
                continue  # stale entry (re-ranked, pinned or gone) or a duplicate
            if key in protected:
                deferred.append(entry)
                continue
            chosen.append(entry)
            chosen_keys.add(key)
        for entry in deferred:
            heapq.heappush(heap, entry)
        if len(chosen) < n:
            for entry in chosen:
                heapq.heappush(heap, entry)
            return None
        victims = []
        for _, key in chosen:
            evictable.remove(key)
            victims.append((key, blocks.pop(key)))
        self._maybe_compact()
        return victims

    def mark_evictable(self, key: bytes) -> None:
        self._evictable.add(key)
        heapq.heappush(self._heap, (self.blocks[key].rank, key))
        self._maybe_compact()

    def mark_non_evictable(self, key: bytes) -> None:
        self._evictable.discard(key)
