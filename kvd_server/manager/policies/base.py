"""The eviction-policy seam: which resident blocks to evict, and how accesses age them.

Mechanism (ref counts, slots, events, epochs) lives in `NamespaceManager`; a policy only
organises blocks and picks victims. The hooks and their order of calls follow vLLM 0.33's
`CachePolicy`, so LRU and ARC evict in exactly the order vLLM's CPU manager does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class Block:
    """One resident block: its slot and ref count (-1 storing, 0 ready, >0 pinned).

    `rank` is policy scratch space (LRU keeps its recency rank here, so a block costs one
    small object and no side dictionary).
    """

    __slots__ = ("slot", "ref", "rank")

    def __init__(self, slot: int, ref: int = -1) -> None:
        self.slot = slot
        self.ref = ref
        self.rank = 0

    @property
    def is_ready(self) -> bool:
        return self.ref >= 0

    def __repr__(self) -> str:
        return f"Block(slot={self.slot}, ref={self.ref})"


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
    if all(key in positions for key in keys):
        keys.sort(key=positions.__getitem__)
    return keys


class Policy(ABC):
    """Organises resident blocks and chooses victims. Owns the key -> Block index."""

    name: str = ""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def get(self, key: bytes) -> Block | None:
        """The resident block of `key`, or None."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def items(self) -> Iterable[tuple[bytes, Block]]:
        """Every resident (key, block)."""

    @abstractmethod
    def insert(self, key: bytes, block: Block, req: RequestState) -> None:
        """Add a newly reserved block (ARC: also leaves the ghost lists)."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Drop a block (a failed store)."""

    @abstractmethod
    def touch(self, keys: Iterable[bytes], req: RequestState) -> None:
        """Explicit recency update."""

    def on_store_miss(self, keys: Iterable[bytes], req: RequestState) -> None:
        """Keys offered for store that are not resident (ARC adapts on ghost hits)."""
        self.touch(keys, req)

    def on_request_access(self, keys: Iterable[bytes], req: RequestState) -> None:  # noqa: B027
        """First sighting of keys by a request (LRU: provisional request rank)."""

    def on_request_finished(self, key_groups: Sequence[Sequence[bytes]],
                            insertion_only: set[bytes], reused: set[bytes],
                            req: RequestState) -> None:
        """Apply a finished request's accesses in prefix order."""
        for keys in key_groups:
            self.touch(keys, req)

    @abstractmethod
    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Block]] | None:
        """Remove exactly n unpinned, unprotected ready blocks, or change nothing (None)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every block and all adaptive state."""

    def mark_evictable(self, key: bytes) -> None:  # noqa: B027
        """ref went to 0."""

    def mark_non_evictable(self, key: bytes) -> None:  # noqa: B027
        """ref left 0."""
