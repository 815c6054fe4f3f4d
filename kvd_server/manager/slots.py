"""A fixed-capacity SlotSource with vLLM 0.33's allocation order (tests, benchmarks)."""

from __future__ import annotations

from collections.abc import Sequence


class FixedSlots:
    """`capacity` slots: never-used ids handed out 0, 1, 2, ... first, then a LIFO free list.

    Matches vLLM's CPU manager allocator exactly, so scenario tests can assert its slot ids.
    """

    __slots__ = ("_capacity", "_allocated", "_free")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self._capacity = capacity
        self._allocated = 0
        self._free: list[int] = []

    def free_count(self) -> int:
        return len(self._free) + self._capacity - self._allocated

    def allocate(self, n: int) -> list[int]:
        fresh = min(n, self._capacity - self._allocated)
        reused = n - fresh
        if reused > len(self._free):
            raise RuntimeError(f"asked for {n} slots with only {self.free_count()} free")
        out = list(range(self._allocated, self._allocated + fresh))
        self._allocated += fresh
        for _ in range(reused):
            out.append(self._free.pop())
        return out

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def free_many(self, slots: Sequence[int], keys: Sequence[bytes] | None = None) -> None:
        self._free.extend(slots)        # nobody is granted slots here: no kept blocks

    def forget_kept(self) -> None:
        return

    def in_limbo(self) -> int:
        return 0                # no readers: freed slots are reusable at once

    def capacity(self) -> int:
        return self._capacity

    def reset(self) -> bool:
        self._allocated = 0
        self._free.clear()
        return True

    def reclaim(self, n: int) -> bool:
        return False  # a fixed capacity: nobody to take from
