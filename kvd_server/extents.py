"""The pool cut into extents, and a namespace's slots cut out of the extents it holds.

A namespace grows by whole extents taken from the shared free list and cuts each into slots of
its own stride; slot ids are namespace-local and map to pool offsets. Allocation order is
vLLM's (never-used ids 0, 1, 2, ... first, then a LIFO free list), so a namespace behaves like
vLLM's CPU manager with a capacity that grows while the pool has free extents.
"""

from __future__ import annotations

from kvd_proto.wire import SLOT_ALIGNMENT, align_up


class ExtentAllocator:
    """Equal extents of the pool (a trailing partial extent is left unused)."""

    def __init__(self, pool_bytes: int, extent_bytes: int) -> None:
        if pool_bytes <= 0:
            raise ValueError("pool size must be positive")
        extent_bytes = min(align_up(extent_bytes), pool_bytes // SLOT_ALIGNMENT * SLOT_ALIGNMENT)
        if extent_bytes <= 0:
            raise ValueError(f"pool of {pool_bytes} bytes is smaller than one page")
        self.pool_bytes = pool_bytes
        self.extent_bytes = extent_bytes
        self.total = pool_bytes // extent_bytes
        # LIFO of free extent indexes, lowest index on top.
        self._free = list(range(self.total - 1, -1, -1))

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, index: int) -> None:
        if not 0 <= index < self.total:
            raise ValueError(f"extent {index} out of range")
        self._free.append(index)

    def free_extents(self) -> int:
        return len(self._free)

    @property
    def used_bytes(self) -> int:
        return (self.total - len(self._free)) * self.extent_bytes

    @property
    def free_bytes(self) -> int:
        return self.pool_bytes - self.used_bytes


class TenantBudget:
    """Extents one tenant may hold across all its namespaces (`tenants.quotas`).

    Counting whole extents keeps the check O(1) and makes a quota mean the same for every
    block size; a namespace of a tenant at its quota evicts its own blocks to store more.
    """

    def __init__(self, tenant: str, max_extents: int | None) -> None:
        self.tenant = tenant
        self.max_extents = max_extents
        self.held = 0

    def room(self, free_extents: int) -> int:
        """Extents the tenant may still take out of `free_extents`."""
        if self.max_extents is None:
            return free_extents
        return max(0, min(free_extents, self.max_extents - self.held))


class NamespaceSlots:
    """A SlotSource over extents taken on demand (see manager/types.py)."""

    def __init__(self, extents: ExtentAllocator, slot_bytes: int,
                 budget: TenantBudget | None = None) -> None:
        if slot_bytes <= 0:
            raise ValueError("slot size must be positive")
        self.stride = align_up(slot_bytes)
        if self.stride > extents.extent_bytes:
            raise ValueError(
                f"a block of {slot_bytes} bytes does not fit in one extent of "
                f"{extents.extent_bytes} bytes; raise pool.extent_size")
        self.extents = extents
        self.per_extent = extents.extent_bytes // self.stride
        self.budget = budget
        self._held: list[int] = []     # extent indexes, in the order taken
        self._position: dict[int, int] = {}  # extent index -> its position in _held
        self._allocated = 0            # never-used ids below this have been handed out
        self._free: list[int] = []
        self._in_use = 0

    # SlotSource
    def capacity(self) -> int:
        free = self.extents.free_extents()
        if self.budget is not None:
            free = self.budget.room(free)
        return (len(self._held) + free) * self.per_extent

    def free_count(self) -> int:
        return self.capacity() - self._in_use

    def allocate(self, n: int) -> list[int]:
        if n > self.free_count():
            raise RuntimeError(f"asked for {n} slots with {self.free_count()} free")
        out: list[int] = []
        while len(out) < n and self._allocated < len(self._held) * self.per_extent:
            out.append(self._allocated)
            self._allocated += 1
        while len(out) < n and self._free:
            out.append(self._free.pop())
        while len(out) < n:
            index = self.extents.take()
            if index is None:  # free_count() said there was room: only a bug gets here
                raise RuntimeError("pool ran out of extents during allocation")
            self._position[index] = len(self._held)
            self._held.append(index)
            if self.budget is not None:
                self.budget.held += 1
            take = min(n - len(out), self.per_extent)
            out.extend(range(self._allocated, self._allocated + take))
            self._allocated += take
        self._in_use += n
        return out

    def free(self, slot: int) -> None:
        self._free.append(slot)
        self._in_use -= 1

    def reset(self) -> None:
        """Every slot free again, fresh order; extents are kept (see release_extents)."""
        self._allocated = 0
        self._free.clear()
        self._in_use = 0

    # offsets
    def offset(self, slot: int) -> int:
        extent = self._held[slot // self.per_extent]
        return extent * self.extents.extent_bytes + (slot % self.per_extent) * self.stride

    def slot_at(self, offset: int) -> int | None:
        ebytes = self.extents.extent_bytes
        extent, within = divmod(offset, ebytes)
        if within % self.stride or within // self.stride >= self.per_extent:
            return None
        pos = self._position.get(extent)
        if pos is None:
            return None
        return pos * self.per_extent + within // self.stride

    def release_extents(self) -> int:
        """Give every extent back to the pool; only when no slot is in use."""
        if self._in_use:
            return 0
        n = len(self._held)
        for index in reversed(self._held):
            self.extents.give(index)
        self._held.clear()
        self._position.clear()
        self.reset()
        if self.budget is not None:
            self.budget.held -= n
        return n

    def extents_held(self) -> int:
        return len(self._held)

    @property
    def in_use(self) -> int:
        return self._in_use
