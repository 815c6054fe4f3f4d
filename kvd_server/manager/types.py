"""Records and the contract shared by the offload manager, its policies and the daemon core.

The manager is pure logic (no I/O, no clock): one `NamespaceManager` per namespace holds the
index key -> block and applies vLLM 0.33's CPUOffloadingManager semantics over a `SlotSource`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Lookup(enum.IntEnum):
    """Answer of a lookup; values equal the wire enum kvd.v1.BlockState."""

    MISS = 1
    HIT = 2
    HIT_PENDING = 3


@dataclass(slots=True, frozen=True)
class OffloadEvent:
    """A stored (removed=False) or removed (removed=True) event, in the order they happened."""

    keys: tuple[bytes, ...]
    removed: bool
    metadata_only: bool = False


@dataclass(slots=True, frozen=True)
class StoreGrant:
    """What prepare_store decided: the new keys to write, their slots, and the evicted keys."""

    keys_to_store: list[bytes]
    slots: list[int]
    evicted_keys: list[bytes]


@dataclass(slots=True, frozen=True)
class OfferResult:
    """What a StoreGranted offer did: the keys now being stored in their granted slots, the
    granted keys another store already had (duplicates), the keys evicted to make room."""

    accepted: list[bytes]
    duplicates: list[bytes]
    evicted: list[bytes]


@dataclass(slots=True)
class BlockCounts:
    """Blocks of one namespace by state (a block is in exactly one of the first three)."""

    storing: int = 0   # reserved, being written, invisible to lookups
    ready: int = 0     # readable, unpinned (evictable unless leased/protected)
    pinned: int = 0    # readable and pinned by at least one load or lease
    zombie: int = 0    # dropped by reset, slot held until its pin/store is released

    @property
    def resident(self) -> int:
        return self.storing + self.ready + self.pinned


class SlotSource(Protocol):
    """Where a namespace's slots come from.

    Slot ids are namespace-local ints. Allocation order must match vLLM 0.33's CPU manager:
    never-used ids sequentially (0, 1, 2, ...) first, then a LIFO free list of freed ids.
    """

    def free_count(self) -> int:
        """Slots that `allocate` can hand out now without eviction (incl. growable capacity)."""
        ...

    def allocate(self, n: int) -> list[int]:
        """Hand out `n` slot ids; the caller checked `free_count() >= n` first."""
        ...

    def in_limbo(self) -> int:
        """Slots freed but not reusable yet (readers may still copy out of them): free once
        every reader has moved past them. As of the last `free_count()`."""
        ...

    def free(self, slot: int) -> None:
        """Give one slot id back."""
        ...

    def free_many(self, slots: Sequence[int]) -> None:
        """`free` of each slot id, in order."""
        ...

    def capacity(self) -> int:
        """Slots this namespace could hold now (allocated + free + growable)."""
        ...

    def reset(self) -> bool:
        """Forget every allocation (all slots free again, fresh order) when the source has no
        other users than the blocks being dropped; False (nothing done) when it cannot, and
        the caller frees the blocks' slots one by one."""
        ...

    def reclaim(self, n: int) -> bool:
        """Try to grow by at least `n` slots at someone else's expense (another namespace
        giving back an extent); True when free_count() grew."""
        ...
