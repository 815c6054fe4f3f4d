"""The eviction-policy seam: which resident blocks to evict, and how accesses age them.

Mechanism (ref counts, slots, events, epochs) lives in `NamespaceManager`; a policy only
organises blocks and picks victims. The hooks and their order of calls follow vLLM 0.33's
`CachePolicy`, so LRU and ARC evict in exactly the order vLLM's CPU manager does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..blocks import BlockTable


@dataclass(slots=True)
class RequestState:
    """What one request did to the cache, applied to the policy when the request finishes.

    The daemon's equivalent of the scratch state vLLM keeps on a ReqContext.
    """

    generation: int
    key_groups: dict[int, list[bytes]] = field(default_factory=dict)
    seen: set[bytes] = field(default_factory=set)
    inserted: set[bytes] = field(default_factory=set)
    reused: set[bytes] = field(default_factory=set)
    store_misses: set[bytes] = field(default_factory=set)
    positions: dict[bytes, int] = field(default_factory=dict)
    lru_rank: int = 0
    lru_generation: int = -1
    finished: bool = False

    def position(self, key: bytes) -> int | None:
        return self.positions.get(key)


def group_of(key: bytes) -> int:
    """KV-group index of a vLLM offload key (its last 4 bytes, big endian)."""
    return int.from_bytes(key[-4:], "big") if len(key) >= 4 else 0


def order_request_keys(key_groups: Sequence[Sequence[bytes]], req: RequestState) -> list[bytes]:
    """One head-to-tail order over all groups: by position when every key has one."""
    keys = [key for group in key_groups for key in group]
    positions = req.positions
    if all(map(positions.__contains__, keys)):
        keys.sort(key=positions.__getitem__)
    return keys


class Policy(ABC):
    """Organises resident blocks and chooses victims. Blocks are slots of the manager's
    `BlockTable` (which also resolves keys); a policy keeps its own per-slot arrays."""

    name: str = ""

    def __init__(self, capacity: int, table: BlockTable) -> None:
        self.capacity = capacity
        self.table = table
        # The manager's open requests (set by its RequestLog), for a policy that orders
        # their blocks apart from its own (LRU renumbers their ranks with its blocks').
        self.open_requests: Iterable[RequestState] = ()

    @abstractmethod
    def insert(self, key: bytes, slot: int, req: RequestState) -> None:
        """A newly reserved block (ARC: also leaves the ghost lists)."""

    def insert_many(self, keys: Sequence[bytes], slots: Sequence[int],
                    req: RequestState) -> None:
        """`insert` of each (key, slot) in order (a store's new blocks)."""
        for key, slot in zip(keys, slots, strict=True):
            self.insert(key, slot, req)

    def remove(self, slot: int) -> None:  # noqa: B027
        """A block left outside eviction (a failed store, an extent taken)."""

    @abstractmethod
    def moved(self, old: int, new: int) -> None:
        """The block in `old` now lives in `new` (a duplicate store completed first)."""

    @abstractmethod
    def touch(self, keys: Iterable[bytes], req: RequestState) -> None:
        """Explicit recency update."""

    def on_store_miss(self, keys: Iterable[bytes], req: RequestState) -> None:
        """Keys offered for store that are not resident (ARC adapts on ghost hits)."""
        self.touch(keys, req)

    def on_request_access(self, keys: Sequence[bytes], req: RequestState,  # noqa: B027
                          slots: Sequence[int] | None = None) -> None:
        """First sighting of keys by a request (LRU: provisional request rank); `slots`, when
        the caller has them, are the keys' slots (-1: not resident)."""

    def on_request_finished(self, key_groups: Sequence[Sequence[bytes]],
                            insertion_only: set[bytes], reused: set[bytes],
                            req: RequestState) -> None:
        """Apply a finished request's accesses in prefix order."""
        for keys in key_groups:
            self.touch(keys, req)

    @abstractmethod
    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, int]] | None:
        """Choose exactly n ready, unpinned, unprotected blocks (key, slot) and forget them,
        or change nothing (None). The manager drops them from the table."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every block and all adaptive state (the table is cleared too)."""

    def hold(self, slot: int) -> None:  # noqa: B027
        """The block in `slot` is retained (manager/retention.py): it is not READY until
        `unhold`, so no eviction picks it; a policy whose scans pass over blocks that are not
        READY takes it out of them meanwhile."""

    def unhold(self, slot: int) -> None:  # noqa: B027
        """The block in `slot` is retained no more (`mark_evictable` follows if it is READY
        then)."""

    def mark_evictable(self, slot: int) -> None:  # noqa: B027
        """The block in `slot` became READY and unpinned."""

    def mark_evictable_many(self, slots: Sequence[int]) -> None:
        """`mark_evictable` of each slot, in order."""
        for slot in slots:
            self.mark_evictable(slot)

    @abstractmethod
    def adopt(self, slots: np.ndarray) -> None:
        """READY blocks a warm restart adopted, least recently used first (no request
        scope, no ghosts: what the previous daemon knew of their use is gone)."""
