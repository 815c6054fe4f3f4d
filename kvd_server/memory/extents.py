"""The pool cut into extents, and a namespace's slots cut out of the extents it holds.

A namespace grows by whole extents taken from the shared free list and cuts each into slots of
its own stride; slot ids are the namespace's (its stride sets `per_extent`) and address the
whole pool: slot `e * per_extent + i` is the i-th slot of the pool's extent e, at pool offset
`e * extent_bytes + i * stride`. Allocation order is vLLM's (never-used ids 0, 1, 2, ...
first, then a LIFO free list), so a namespace behaves like vLLM's CPU manager with a capacity
that grows while the pool has free extents.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import numpy as np

from kvd_proto.wire import SLOT_ALIGNMENT, align_up
from kvd_server.config import DEFAULT_TENANT

RUN_BATCH = 4096     # slots of a run (an array of free slots) made Python ints at once


class ExtentAllocator:
    """Equal extents of the pool (a trailing partial extent is left unused).

    Each tenant has its own memory file of the pool's size (kvd_server/memory/pool.py); an extent's
    pages live in the file of the tenant that last held it. `owner` remembers which, and
    `on_move(extent, from_tenant, to_tenant)` is told when an extent changes tenant, so the
    pages can move too (punched out of one file, populated in the other).
    """

    def __init__(self, pool_bytes: int, extent_bytes: int, *, first_owner: str | None = None,
                 on_move: Callable[[int, str | None, str], None] | None = None) -> None:
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
        self.owner: list[str | None] = [first_owner] * self.total
        self.on_move = on_move

    def take(self, tenant: str = DEFAULT_TENANT, index: int | None = None) -> int | None:
        """A free extent for `tenant` (the one numbered `index`, if it is free); None if none."""
        if index is None:
            if not self._free:
                return None
            index = self._free.pop()
        elif index in self._free:
            self._free.remove(index)
        else:
            return None
        previous = self.owner[index]
        if previous != tenant:
            self.owner[index] = tenant
            if self.on_move is not None:
                self.on_move(index, previous, tenant)
        return index

    def give(self, index: int) -> None:
        if not 0 <= index < self.total:
            raise ValueError(f"extent {index} out of range")
        self._free.append(index)

    def claim(self, index: int, tenant: str) -> bool:
        """Take the free extent `index` for `tenant` as it is (a warm restart adopting the
        blocks in it: its pages are in that tenant's file already, nothing moves)."""
        if index not in self._free:
            return False
        self._free.remove(index)
        self.owner[index] = tenant
        return True

    def hold_back(self) -> list[int]:
        """Take every free extent out of use (a warm restart: an engine of the previous daemon
        may still write into slots it was granted there); give them back with `give`."""
        held, self._free = self._free, []
        return held

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


class Limbo(Protocol):
    """Freed slots that may not be reused yet (kvd_server/shm_index.Reclamation)."""

    in_limbo: int

    @property
    def active(self) -> bool: ...

    def retire(self, slot: int) -> None: ...

    def retire_many(self, slots: list[int]) -> None: ...

    def retire_run(self, slots: np.ndarray) -> None: ...

    def collect(self) -> list[int]: ...       # a run retired whole comes back as its array


def slot_geometry(extent_bytes: int, slot_bytes: int) -> tuple[int, int]:
    """(stride, slots per extent) of blocks of `slot_bytes` in extents of `extent_bytes`;
    ValueError when a block does not fit one extent."""
    if slot_bytes <= 0:
        raise ValueError("slot size must be positive")
    stride = align_up(slot_bytes)
    if stride > extent_bytes:
        raise ValueError(f"a block of {slot_bytes} bytes does not fit in one extent of "
                         f"{extent_bytes} bytes; raise pool.extent_size")
    return stride, extent_bytes // stride


class NamespaceSlots:
    """A SlotSource over extents taken on demand (see manager/types.py).

    Slot ids as in the module doc (the namespace's, over the pool's extent numbers), so ids
    stay valid when another extent is given back. Order is vLLM's: never-used slots of the held
    extents first (extent by extent, in the order taken), then the LIFO free list, then a new
    extent. A namespace that needs room the free extents cannot give may `reclaim` extents
    from other namespaces through the table that owns it (fair share, kvd_server/core/namespaces.py).

    An extent taken from this namespace whose freed slots still wait in limbo (engines may be
    reading them) cannot change hands yet: it is *draining* (`drain`). None of its slots is
    handed out again; as the last one leaves limbo the extent goes back to the pool and to
    the namespace it was taken for (`adopt`), so the taker gets it without evicting again.
    """

    def __init__(self, extents: ExtentAllocator, slot_bytes: int,
                 budget: TenantBudget | None = None,
                 reclaimer: Callable[[NamespaceSlots, int], bool] | None = None,
                 limbo: Limbo | None = None) -> None:
        self.stride, self.per_extent = slot_geometry(extents.extent_bytes, slot_bytes)
        self.extents = extents
        self.budget = budget
        self.tenant = budget.tenant if budget is not None else DEFAULT_TENANT
        self.reclaimer = reclaimer
        # Freed slots wait here while engines may still read them (shm_index.Reclamation).
        self.limbo = limbo
        self._held: list[int] = []          # extent indexes, in the order taken
        self._fresh: deque[int] = deque()   # held extents with never-used slots, in order
        self._high: dict[int, int] = {}     # extent -> slots of it handed out since taken
        self._used: dict[int, int] = {}     # extent -> slots of it in use now
        self._free: list[int] = []
        # Older free slots beneath `_free` (a stack of stacks, the newest last): an adopted
        # extent's idle slots out of limbo as one array (16k slots of 4 KiB in 64 MiB: never a
        # Python int each until handed out), and the lists that were on top when one came.
        self._free_below: list[list[int] | np.ndarray] = []
        self._runs_in_limbo = 0             # arrays retired whole (retire_run) not back yet
        # Free (or retired) slots that still hold the block evicted from them, intact: slot ->
        # its key (`free_many` with keys). An entry lives from the eviction to the slot's next
        # allocation (which pops it) or its extent's leaving; only slots of `_free` and
        # limbo have one, so it is bounded by them.
        self.kept: dict[int, bytes] = {}
        self._in_use = 0
        self._retired: dict[int, int] = {}  # extent -> slots of it waiting in limbo
        # Draining extents -> the namespace each is emptied for (None: the pool); their
        # slots not in use are no capacity (`_draining_idle` of them).
        self._draining: dict[int, NamespaceSlots | None] = {}
        self._draining_idle = 0
        self.incoming = 0                   # extents draining elsewhere for this namespace
        self.closed = False                 # its namespace is gone: it adopts nothing

    # SlotSource
    def capacity(self) -> int:
        free = self.extents.free_extents()
        if self.budget is not None:
            free = self.budget.room(free)
        return (len(self._held) + free) * self.per_extent - self._draining_idle

    def free_count(self) -> int:
        self.collect()
        return self.capacity() - self._in_use

    def allocate(self, n: int, kept: list[bytes | None] | None = None) -> list[int]:
        """`n` free slots. `kept` (a list): each slot's intact evicted block's key appended
        to it, None for a slot that holds none; every allocation forgets them either way."""
        self.collect()
        if n > self.free_count():
            raise RuntimeError(f"asked for {n} slots with {self.free_count()} free")
        out: list[int] = []
        per = self.per_extent
        while len(out) < n:
            if self._fresh:
                e = self._fresh[0]
                i = self._high[e]
                take = min(n - len(out), per - i)
                out.extend(range(e * per + i, e * per + i + take))
                self._high[e] = i + take
                if i + take == per:
                    self._fresh.popleft()
            elif self._free:
                out.append(self._free.pop())
            elif self._free_below:
                self._next_free()
            else:
                index = self.extents.take(self.tenant)
                if index is None:  # free_count() said there was room: only a bug gets here
                    raise RuntimeError("pool ran out of extents during allocation")
                self._hold(index)
        for slot in out:
            self._used[slot // per] += 1
        self._in_use += n
        if self.kept:
            pop = self.kept.pop
            if kept is None:
                for slot in out:
                    pop(slot, None)
            else:
                kept.extend([pop(slot, None) for slot in out])
        elif kept is not None:
            kept.extend([None] * n)
        return out

    def _hold(self, index: int) -> None:
        self._held.append(index)
        self._high[index] = 0
        self._used[index] = 0
        self._retired[index] = 0
        self._fresh.append(index)
        if self.budget is not None:
            self.budget.held += 1

    def in_limbo(self) -> int:
        return self.limbo.in_limbo if self.limbo is not None else 0

    def adopt_extent(self, extent: int, ready: int, idle: list[int] | np.ndarray) -> bool:
        """Warm restart: hold `extent` again with `ready` blocks the index still shows in it;
        its other slots (`idle`: free, or a store's the crash interrupted) wait in limbo,
        since an engine of the previous daemon may still read or write them, and come back
        once every reader has moved past them (kvd_server/restart/). False when the extent
        is not free or the tenant's quota has no room. An array of `idle` slots (ascending)
        stays one array through limbo and the free slots: the cost follows the extents, not
        their slots."""
        budget = self.budget
        if budget is not None and budget.room(1) == 0:
            return False
        if not self.extents.claim(extent, self.tenant):
            return False
        self._hold(extent)
        self._fresh.remove(extent)
        per = self.per_extent
        self._high[extent] = per
        self._used[extent] = ready + len(idle)
        self._in_use += ready + len(idle)
        if len(idle):
            if self.limbo is not None:
                if isinstance(idle, np.ndarray):
                    self.limbo.retire_run(idle)
                    self._runs_in_limbo += 1
                else:
                    self.limbo.retire_many(idle)
                self._retired[extent] += len(idle)
            elif isinstance(idle, np.ndarray):
                self._release_run(idle)
            else:
                for slot in idle:
                    self._release(slot)
        return True

    def free(self, slot: int) -> None:
        """Give a slot back: at once, or after every engine reading the namespace's index
        has moved past it (it stays in use meanwhile)."""
        if self.limbo is not None and self.limbo.active:
            self.limbo.retire(slot)
            self._retired[slot // self.per_extent] += 1
            return
        self._release(slot)

    def free_many(self, slots: Sequence[int], keys: Sequence[bytes] | None = None) -> None:
        """`free` of each slot (an eviction's victims, in one call). `keys`: the blocks the
        slots still hold intact (evicted READY, nothing written since), kept until each slot
        is allocated again (`allocate`'s `kept`)."""
        if keys is not None:
            self.kept.update(zip(slots, keys, strict=True))
        if self.limbo is not None and self.limbo.active:
            self.limbo.retire_many(list(slots))
            retired, per = self._retired, self.per_extent
            for slot in slots:
                retired[slot // per] += 1
            return
        self._release_many(slots)

    def _release_many(self, slots: Sequence[int]) -> None:
        """`_release` of each slot; while no extent drains, in one pass."""
        if self._draining:
            for slot in slots:
                self._release(slot)
            return
        used, per = self._used, self.per_extent
        for slot in slots:
            used[slot // per] -= 1
        self._in_use -= len(slots)
        self._free.extend(slots)

    def _release(self, slot: int) -> None:
        extent = slot // self.per_extent
        self._used[extent] -= 1
        self._in_use -= 1
        if self._draining and extent in self._draining:
            self._draining_idle += 1
            if not self._used[extent]:
                self._drained(extent)
            return
        self._free.append(slot)

    def collect(self) -> None:
        """Reuse the retired slots every reader has moved past."""
        if self.limbo is not None:
            slots = self.limbo.collect()
            if slots:
                if self._runs_in_limbo:
                    slots = self._collect_runs(slots)
                retired, per = self._retired, self.per_extent
                for slot in slots:
                    retired[slot // per] -= 1
                self._release_many(slots)

    def _collect_runs(self, slots: list) -> list[int]:
        """The runs (arrays) among what limbo gave back released whole; the single slots."""
        single: list[int] = []
        for item in slots:
            if isinstance(item, np.ndarray):
                self._runs_in_limbo -= 1
                self._retired[int(item[0]) // self.per_extent] -= len(item)
                self._release_run(item)
            else:
                single.append(item)
        return single

    def _release_run(self, run: np.ndarray) -> None:
        """`_release` of each slot of `run` (ascending, one extent's), without a Python int
        per slot: the array goes onto the free slots whole (popped from its end, as a list
        extended with it would be)."""
        extent = int(run[0]) // self.per_extent
        self._used[extent] -= len(run)
        self._in_use -= len(run)
        if self._draining and extent in self._draining:
            self._draining_idle += len(run)
            if not self._used[extent]:
                self._drained(extent)
            return
        if self._free:
            self._free_below.append(self._free)
            self._free = []
        self._free_below.append(run)

    def _next_free(self) -> None:
        """`_free` is empty: refill it from the newest stack beneath (a list whole, or the
        top of an array, a bounded number of its slots at a time)."""
        below = self._free_below[-1]
        if isinstance(below, list):
            self._free = self._free_below.pop()
            return
        take = below[-RUN_BATCH:]
        self._free = take.tolist()
        if len(take) == len(below):
            self._free_below.pop()
        else:
            self._free_below[-1] = below[:-RUN_BATCH]

    def forget_kept(self) -> None:
        """No freed slot's block is named again (a reset dropped them)."""
        self.kept.clear()

    def _drop_free_of(self, extent: int) -> None:
        """Free slots of `extent` are no longer handed out (it drains or leaves)."""
        per = self.per_extent
        if self.kept:
            for slot in [s for s in self.kept if s // per == extent]:
                del self.kept[slot]
        self._free = [s for s in self._free if s // per != extent]
        if self._free_below:
            remaining: list[list[int] | np.ndarray] = []
            for below in self._free_below:
                if isinstance(below, list):
                    below = [s for s in below if s // per != extent]
                else:
                    below = below[below // per != extent]
                if len(below):
                    remaining.append(below)
            self._free_below = remaining

    def reset(self) -> bool:
        """Never all at once: granted, held and retired slots are in use too."""
        return False

    def reclaim(self, n: int) -> bool:
        """Try to make room for `n` more slots by taking extents from other namespaces."""
        return self.reclaimer is not None and self.reclaimer(self, n)

    # offsets
    def offset(self, slot: int) -> int:
        e, i = divmod(slot, self.per_extent)
        return e * self.extents.extent_bytes + i * self.stride

    def offsets(self, slots: Iterable[int]) -> list[int]:
        """`offset` of each slot (a grant's worth in one call)."""
        ebytes, stride, per = self.extents.extent_bytes, self.stride, self.per_extent
        return [slot // per * ebytes + slot % per * stride for slot in slots]

    def slot_at(self, offset: int) -> int | None:
        ebytes = self.extents.extent_bytes
        extent, within = divmod(offset, ebytes)
        if within % self.stride or within // self.stride >= self.per_extent \
                or extent not in self._used:
            return None
        return extent * self.per_extent + within // self.stride

    def slots_at(self, offsets: Iterable[int]) -> list[int | None]:
        """`slot_at` of each offset (a record's worth in one call)."""
        ebytes, stride, per, used = self.extents.extent_bytes, self.stride, \
            self.per_extent, self._used
        out: list[int | None] = []
        if per * stride == ebytes:       # slots fill their extents: a slot id is offset / stride
            for offset in offsets:
                index, rest = divmod(offset, stride)
                out.append(None if rest or index // per not in used else index)
            return out
        for offset in offsets:
            extent, within = divmod(offset, ebytes)
            index, rest = divmod(within, stride)
            out.append(None if rest or index >= per or extent not in used
                       else extent * per + index)
        return out

    # extents
    def extents_held(self) -> int:
        return len(self._held)

    def held(self) -> list[int]:
        return list(self._held)

    def used_in(self, extent: int) -> int:
        """Slots of `extent` in use now (those waiting in limbo included)."""
        return self._used.get(extent, 0)

    def retired_in(self, extent: int) -> int:
        """Slots of `extent` waiting in limbo."""
        return self._retired.get(extent, 0)

    def draining(self) -> int:
        """Held extents being emptied for another namespace (or the pool)."""
        return len(self._draining)

    def is_draining(self, extent: int) -> bool:
        return extent in self._draining

    def drain(self, extent: int, taker: NamespaceSlots | None = None) -> bool:
        """Give `extent` up (its blocks evicted already): back to the pool now if none of its
        slots is in use (True); else no slot of it is handed out again and it goes to the
        pool, then to `taker` (`adopt`), once its last slot leaves limbo (False)."""
        self.collect()                      # what readers have moved past comes back now
        if extent in self._draining:
            return False
        if not self._used[extent]:
            self.release_extent(extent)
            return True
        per = self.per_extent
        self._draining[extent] = taker
        self._draining_idle += per - self._used[extent]
        if taker is not None:
            taker.incoming += 1
        if extent in self._fresh:
            self._fresh.remove(extent)
        self._drop_free_of(extent)
        return False

    def _drained(self, extent: int) -> None:
        """The last slot of a draining extent left limbo: hand the extent over."""
        taker = self._draining.pop(extent)
        self._draining_idle -= self.per_extent
        self.release_extent(extent)
        if taker is not None:
            taker.incoming -= 1
            taker.adopt(extent)

    def adopt(self, extent: int) -> bool:
        """Take the free extent `extent` (drained for this namespace), if it is still free,
        this namespace still exists and its tenant's quota has room for it."""
        budget = self.budget
        if self.closed or (budget is not None and budget.room(1) == 0):
            return False
        index = self.extents.take(self.tenant, extent)
        if index is None:
            return False
        self._hold(index)
        return True

    def slots_in(self, extent: int) -> range:
        """Every slot id of `extent` that has been handed out since it was taken."""
        base = extent * self.per_extent
        return range(base, base + self._high.get(extent, 0))

    def release_extent(self, extent: int) -> None:
        """Give one held extent back to the pool; none of its slots may be in use."""
        if self._used.get(extent):
            raise RuntimeError(f"extent {extent} still has {self._used[extent]} slots in use")
        self._held.remove(extent)
        del self._high[extent]
        del self._used[extent]
        self._retired.pop(extent, None)
        if extent in self._fresh:
            self._fresh.remove(extent)
        self._drop_free_of(extent)
        self.extents.give(extent)
        if self.budget is not None:
            self.budget.held -= 1

    def release_extents(self) -> int:
        """Give every extent back to the pool; only when no slot is in use."""
        if self._in_use:
            return 0
        n = len(self._held)
        for index in reversed(self._held):
            self.extents.give(index)
        self._held.clear()
        self._high.clear()
        self._used.clear()
        self._retired.clear()
        self._fresh.clear()
        self._free.clear()
        self._free_below.clear()
        self.kept.clear()
        if self.budget is not None:
            self.budget.held -= n
        return n

    @property
    def in_use(self) -> int:
        return self._in_use
