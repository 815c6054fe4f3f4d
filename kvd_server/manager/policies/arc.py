"""ARC: adaptive replacement between recency (T1) and frequency (T2), vLLM 0.33 semantics.

T1 holds blocks used once, T2 blocks reused by a request; B1/B2 remember recently evicted keys.
A store miss on a B1 ghost grows the T1 target, on a B2 ghost shrinks it. Eviction takes T1's
oldest evictable block while |T1| >= target, else T2's, falling back to the other list, and is
all-or-nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from .base import Block, Policy, RequestState, order_request_keys


class ARCPolicy(Policy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1_size = 0.0
        self.t1: OrderedDict[bytes, Block] = OrderedDict()
        self.t2: OrderedDict[bytes, Block] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def get(self, key: bytes) -> Block | None:
        block = self.t1.get(key)
        return block if block is not None else self.t2.get(key)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def items(self) -> Iterable[tuple[bytes, Block]]:
        yield from self.t1.items()
        yield from self.t2.items()

    def insert(self, key: bytes, block: Block, req: RequestState) -> None:
        self.t1[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: bytes) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

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
        for key in reversed(list(keys)):
            self._ghost_hit(key)

    def touch(self, keys: Iterable[bytes], req: RequestState) -> None:
        for key in reversed(list(keys)):
            if key in self.t1:
                block = self.t1.pop(key)
                if block.is_ready:
                    self.t2[key] = block
                else:  # only just reserved for a store: not a second use
                    self.t1[key] = block
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._ghost_hit(key)

    def on_request_finished(self, key_groups: Sequence[Sequence[bytes]],
                            insertion_only: set[bytes], reused: set[bytes],
                            req: RequestState) -> None:
        for key in reversed(order_request_keys(key_groups, req)):
            if key in insertion_only:
                # Storing is not a frequency hit: keep the list, refresh recency.
                if key in self.t1:
                    self.t1.move_to_end(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)
                continue
            if key in reused:
                if key in self.t1:
                    self.t2[key] = self.t1.pop(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = 0.0

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Block]] | None:
        if n == 0:
            return []

        def scan(entries: Iterator[tuple[bytes, Block]]) -> tuple[bytes, Block] | None:
            for key, block in entries:
                if block.ref == 0 and key not in protected:
                    return key, block
            return None

        # Scans only move forward, so a batch eviction stays linear.
        t1_iter, t2_iter = iter(self.t1.items()), iter(self.t2.items())
        t1_size = len(self.t1)
        chosen: list[tuple[bytes, Block, bool]] = []
        for _ in range(n):
            pick: tuple[bytes, Block, bool] | None = None
            if t1_size >= int(self.target_t1_size):
                entry = scan(t1_iter)
                if entry is not None:
                    pick, t1_size = (*entry, True), t1_size - 1
            if pick is None:
                entry = scan(t2_iter)
                if entry is not None:
                    pick = (*entry, False)
            if pick is None:
                entry = scan(t1_iter)
                if entry is None:
                    return None
                pick, t1_size = (*entry, True), t1_size - 1
            chosen.append(pick)
        victims = []
        for key, block, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
            victims.append((key, block))
        for ghosts in (self.b1, self.b2):
            for _ in range(len(ghosts) - self.capacity):
                ghosts.popitem(last=False)
        return victims
