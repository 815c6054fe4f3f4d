"""Two tiers below the pool as one: the local disk, with the cluster store under it.

The tier machinery (demotion, promotion, the "held below" tables: kvd_server/tiers/link.py)
drives one `Tier`; a stack is that tier for a daemon with both `[tiers.disk]` and
`[tiers.cluster]`:

- what the pool evicts goes to the disk (the upper tier); the cluster tier publishes blocks as
  they are stored (`publish = "stored"`, the demoter hands them over) or, with `"evicted"`,
  gets the evicted blocks too;
- a promotion reads the disk when it holds the block, else the cluster store;
- a block is held below while either holds it: a block one tier drops (the disk evicted it,
  the store lost it) is told as dropped only when the other does not hold it either, so its
  removed event waits for the last copy.

Each tier keeps its own health, counters and threads: `parts` names them (the daemon reports
and publishes the health of each).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from kvd_server.tiers.base import Tier, TierKey, TierStats


class TierStack(Tier):
    """`upper` (the disk) over `lower` (the cluster store), as one Tier (see the module doc)."""

    name = "stack"

    def __init__(self, upper: Tier, lower: Tier) -> None:
        self.upper, self.lower = upper, lower
        self.publishes_stored = lower.publishes_stored
        self.on_dropped: Callable[[list[TierKey]], None] | None = None
        self.on_named: Callable[[list[TierKey], bool], None] | None = None
        upper.on_dropped = lambda keys: self._dropped(keys, lower)
        lower.on_dropped = lambda keys: self._dropped(keys, upper)
        lower.on_named = self._named      # keys the cluster store lost

    @property
    def parts(self) -> tuple[Tier, ...]:
        """The disk and the cluster store, each with its own stats and health."""
        return (self.upper, self.lower)

    def _dropped(self, keys: list[TierKey], other: Tier) -> None:
        gone = [k for k in keys if not other.contains(k)]
        if gone and self.on_dropped is not None:
            self.on_dropped(gone)

    def _named(self, keys: list[TierKey], found: bool) -> None:
        if not found:                     # still named while the disk holds them
            keys = [k for k in keys if not self.upper.contains(k)]
        if keys and self.on_named is not None:
            self.on_named(keys, found)

    def join_namespace(self, namespace: str, tenant: str, block_bytes: int = 0) -> None:
        for part in self.parts:
            part.join_namespace(namespace, tenant, block_bytes)

    def find_flags(self, tenant: str) -> int:
        return self.lower.find_flags(tenant)

    def find(self, namespace: str, keys: Sequence[bytes]) -> Future[list[bytes]] | None:
        """The cluster store is asked (a key the disk held was named held below already)."""
        return self.lower.find(namespace, keys)

    @property
    def readable(self) -> bool:
        return self.upper.readable or self.lower.readable

    def contains(self, key: TierKey) -> bool:
        return self.upper.contains(key) or self.lower.contains(key)

    def keys(self, namespace: str) -> list[bytes]:
        return list(dict.fromkeys([*self.upper.keys(namespace), *self.lower.keys(namespace)]))

    def demote(self, key: TierKey, data: memoryview | bytes) -> Future[bool] | None:
        """To the disk; to the cluster store too when it takes evicted blocks (else it had
        the block when it was stored)."""
        lower = None if self.publishes_stored else self.lower.demote(key, data)
        upper = self.upper.demote(key, data)
        return upper if upper is not None else lower

    def publish(self, key: TierKey, data: memoryview | bytes) -> Future[bool] | None:
        """A block as it is stored (`publishes_stored`): to the cluster store."""
        return self.lower.demote(key, data)

    def promote(self, key: TierKey, dest: memoryview) -> Future[bool] | None:
        if self.upper.contains(key) and self.upper.readable:
            future = self.upper.promote(key, dest)
            if future is not None:
                return future
        return self.lower.promote(key, dest)

    def remove(self, key: TierKey) -> bool:
        upper = self.upper.remove(key)
        return self.lower.remove(key) or upper

    def remove_namespace(self, namespace: str) -> int:
        return max(self.upper.remove_namespace(namespace),
                   self.lower.remove_namespace(namespace))

    def stats(self) -> TierStats:
        """The disk's, with both capacities (the held-below tables are sized by it); each
        tier's own: `part.stats()` for each of `parts`."""
        upper = self.upper.stats()
        return dataclasses.replace(upper, capacity_bytes=upper.capacity_bytes
                                   + self.lower.stats().capacity_bytes)

    def close(self) -> None:
        self.upper.close()
        self.lower.close()
