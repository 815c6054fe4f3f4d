"""Joins a tier to the daemon: what the pool evicts goes down to it, what it drops is told.

Every namespace's manager gets the demoter, bound to it, as its `BelowPort`
(`NamespaceManager.attach_below`, kvd_server/manager/types.py): the blocks its
policy evicts are handed to `Tier.demote` before their slots are freed (the tier copies them at
once, then writes them on its own threads), and their removed events wait until no tier holds
them. A demotion that fails later, and a block the tier itself evicts or finds corrupt, is
told to its namespace on the daemon's event loop (`lost_below`: a removed event when the pool
does not hold it either). A namespace's reset drops its blocks from the tier too. What the
tier holds is named to the namespace's engines in its "held below" table (BelowTables): a
block once written, no longer once lost. A tier that shares blocks between nodes
(`publishes_stored`: the cluster tier) is also handed every block as it is stored. At a clean
stop without warm restart the pool's READY blocks are written down too (`write_down`, bounded
in time), so that the next daemon finds them below.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvd_server.errors import NotFound
from kvd_server.manager.blocks import READY
from kvd_server.manager.types import BelowPort
from kvd_server.tiers.base import Tier, TierKey, succeeded
from kvd_server.tiers.below_table import BelowTables
from kvd_server.tiers.loop_inbox import LoopInbox

if TYPE_CHECKING:
    from kvd_server.core.namespaces import Namespace, NamespaceTable
    from kvd_server.memory.tenant_pools import TenantPools


@dataclass(slots=True)
class WrittenDown:
    """What a stop's write-down of the pool did, block by block (`Demoter.write_down`)."""

    total: int = 0            # READY blocks in the pool
    written: int = 0          # written now
    held: int = 0             # the tier held them already (promoted from it, say)
    failed: int = 0           # refused by a tier that takes none now, or failed to write
    finishing: int = 0        # handed over, still being written when the time ran out
    left: int = 0             # not handed over: the time ran out first


class Demoter:
    """One tier below the pool, joined to a daemon's namespaces (see the module doc)."""

    def __init__(self, tier: Tier, namespaces: NamespaceTable, pools: TenantPools,
                 tables: BelowTables, loop: asyncio.AbstractEventLoop) -> None:
        self.tier = tier
        self._namespaces = namespaces
        self._pools = pools
        self._tables = tables
        self._loop = loop
        self._held: LoopInbox[TierKey] = LoopInbox(loop, tables.held)
        tier.on_dropped = self._dropped_async

    def join(self, ns: Namespace) -> None:
        """Make the tier what lies below the namespace's blocks (its manager's port)."""
        port: BelowPort = NamespaceDemoter(self, ns)
        ns.mgr.attach_below(port)

    def reset(self, ns: Namespace) -> int:
        """The namespace is reset: the tier drops its blocks, its engines are told; how many
        blocks the tier dropped."""
        dropped = self.tier.remove_namespace(ns.id)
        self._tables.clear(ns.id)
        return dropped

    def stored(self, ns: Namespace, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Blocks of `ns` became readable: a tier that publishes every stored block (the
        cluster tier, by default) is handed them now; any other hears nothing of stores."""
        if self.tier.publishes_stored:
            self.demote(ns, list(zip(keys, slots, strict=True)), self.tier.publish)

    def demote(self, ns: Namespace, victims: Sequence[tuple[bytes, int]],
               write: Callable[[TierKey, memoryview], Future[bool] | None] | None = None
               ) -> Collection[bytes]:
        """Hand evicted blocks to the tier (on the event loop, before their slots are freed),
        or, with `write` (the tier's `publish`), stored blocks; the keys it took."""
        write = write or self.tier.demote
        kept: set[bytes] = set()
        held: list[TierKey] = []
        lost: list[TierKey] = []
        n = ns.layout.block_bytes
        with self._pools.for_tenant(ns.tenant).view() as pool:
            for key, slot in victims:
                start = ns.slots.offset(slot)
                tier_key = TierKey(ns.id, key, ns.tenant)
                future = write(tier_key, pool[start:start + n])
                if future is None:
                    continue
                kept.add(key)
                if future.done():   # answered at once (held already): no callback, no wake-up
                    (held if succeeded(future) else lost).append(tier_key)
                else:
                    future.add_done_callback(lambda f, _k=tier_key: self._written(f, _k))
        if held:
            self._tables.held(held)
        if lost:                    # told after the eviction that asked, as from a thread
            self._loop.call_soon(self._lost, lost)
        return kept

    async def write_down(self, seconds: float) -> WrittenDown:
        """A clean stop (the ways in closed, nothing stored any more): hand every READY block
        of the pool to the tier, in slot order, for at most `seconds`; what the tier's queue
        cannot take yet waits for its writes (the event loop is free meanwhile), a tier that
        takes nothing with nothing in flight (degraded) ends it. Writes still in flight at
        the deadline are finished by the tier's close (bounded by its queue)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        out = WrittenDown()
        pending: set[asyncio.Future[bool]] = set()

        def count(done: set[asyncio.Future[bool]]) -> None:
            for f in done:
                ok = not f.cancelled() and f.exception() is None and bool(f.result())
                out.written += ok
                out.failed += not ok

        blocks = [(ns, np.flatnonzero(ns.mgr.table.state_array >= READY))
                  for ns in list(self._namespaces)]
        out.total = sum(len(slots) for _, slots in blocks)
        handed = 0
        for ns, slots in blocks:
            n, table = ns.layout.block_bytes, ns.mgr.table
            with self._pools.for_tenant(ns.tenant).view() as pool:
                i = 0
                while i < len(slots) and loop.time() < deadline:
                    slot = int(slots[i])
                    start = ns.slots.offset(slot)
                    key = TierKey(ns.id, table.key_of(slot), ns.tenant)
                    future = self.tier.demote(key, pool[start:start + n])
                    if future is None:
                        if not pending:        # refused with nothing in flight: none taken
                            out.failed += len(slots) - i
                            handed += len(slots) - i
                            break
                        done, pending = await asyncio.wait(
                            pending, timeout=max(0.0, deadline - loop.time()),
                            return_when=asyncio.FIRST_COMPLETED)
                        count(done)
                        continue
                    i += 1
                    handed += 1
                    if future.done():          # held already (or answered at once)
                        out.held += succeeded(future)
                        out.failed += not succeeded(future)
                    else:
                        pending.add(asyncio.wrap_future(future))
        if pending:
            done, pending = await asyncio.wait(pending,
                                               timeout=max(0.0, deadline - loop.time()))
            count(done)
        out.finishing = len(pending)
        out.left = out.total - handed
        return out

    def _written(self, future: Future[bool], key: TierKey) -> None:
        """On an I/O thread: a demotion ended; a failed one loses the block."""
        if not succeeded(future):
            self._dropped_async([key])
        else:
            self._held.put(key)

    def _dropped_async(self, keys: list[TierKey]) -> None:
        """From any thread: blocks the tier no longer holds; told on the event loop."""
        with contextlib.suppress(RuntimeError):     # a closed loop: the daemon is stopping
            self._loop.call_soon_threadsafe(self._lost, keys)

    def _lost(self, keys: list[TierKey]) -> None:
        self._tables.lost(keys)
        by_ns: dict[str, list[bytes]] = {}
        for k in keys:
            by_ns.setdefault(k.namespace, []).append(k.key)
        for ns_id, lost in by_ns.items():
            try:
                ns = self._namespaces.get(ns_id)
            except NotFound:                  # forgotten meanwhile: no one to tell
                continue
            ns.mgr.lost_below(lost)


class NamespaceDemoter:
    """The demoter bound to one namespace: that namespace manager's `BelowPort`."""

    __slots__ = ("_demoter", "_ns")

    def __init__(self, demoter: Demoter, ns: Namespace) -> None:
        self._demoter = demoter
        self._ns = ns

    def demote(self, victims: Sequence[tuple[bytes, int]]) -> Collection[bytes]:
        return self._demoter.demote(self._ns, victims)

    def stored(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        self._demoter.stored(self._ns, keys, slots)

    def reset(self) -> int:
        return self._demoter.reset(self._ns)
