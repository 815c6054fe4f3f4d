"""Records and the contracts shared by the offload manager, its policies and the daemon core.

The manager is pure logic (no I/O, no clock): one `NamespaceManager` per namespace holds the
index key -> block and applies vLLM 0.33's CPUOffloadingManager semantics over a `SlotSource`,
with a `BelowPort` to what lies under the pool (`NO_BELOW` without a tier).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvd_proto.wire import BlockState

# Answer of a lookup: the wire's block states (kvd_proto/wire.py), MISS / HIT / HIT_PENDING.
Lookup = BlockState


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
    """Blocks of one namespace by state (a block is in exactly one of the first four)."""

    storing: int = 0   # reserved, being written, invisible to lookups
    ready: int = 0     # readable, unpinned (evictable unless leased/protected)
    pinned: int = 0    # readable and pinned by at least one load or lease, not retained
    zombie: int = 0    # dropped by reset, slot held until its pin/store is released
    retained: int = 0  # readable and retained by an agent session's hint (pinned or not)

    @property
    def resident(self) -> int:
        return self.storing + self.ready + self.pinned + self.retained


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

    def free_many(self, slots: Sequence[int], keys: Sequence[bytes] | None = None) -> None:
        """`free` of each slot id, in order; `keys`: the evicted blocks the slots still hold
        (an eviction's), which the source may name when it hands the slots out again."""
        ...

    def forget_kept(self) -> None:
        """No freed slot's block may be named again (a reset dropped them)."""
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


class BelowPort(Protocol):
    """What a namespace's manager needs of the tiers under the pool: one port, the tier's
    demoter bound to the namespace (kvd_server/tiers/demotion.py), or `NO_BELOW`. Called on
    the event loop; a port never calls back into the manager from these."""

    def demote(self, victims: Sequence[tuple[bytes, int]]) -> Collection[bytes]:
        """Evicted (key, slot) blocks, before their slots are freed: the tier copies what it
        takes now; the keys it took (their removed events wait until no tier holds them)."""
        ...

    def stored(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Blocks that just became readable, in their slots (a tier that publishes every
        stored block copies them from there)."""
        ...

    def reset(self) -> int:
        """The namespace is reset: what the tiers hold of it goes too; how many blocks they
        dropped (`kvd reset` counts them)."""
        ...


class NoBelow:
    """The `BelowPort` of a namespace without a tier: nothing is kept below, nothing told."""

    __slots__ = ()

    def demote(self, victims: Sequence[tuple[bytes, int]]) -> Collection[bytes]:
        return ()

    def stored(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        return None

    def reset(self) -> int:
        return 0


NO_BELOW: BelowPort = NoBelow()
