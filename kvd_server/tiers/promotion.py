"""Promotion: a key held only below the pool comes back into a pool slot.

An engine whose lookup misses the index but finds the key in its namespace's "held below"
table (kvd_server/tiers/below_table.py) answers HIT_PENDING and asks for the key (a PROMOTE
channel record; a gRPC Lookup asks by itself). `Promoter.promote` then, on the event loop:
takes a pool slot for the key as a store would (the namespace's policy evicts for all the keys
asked at once, none of them a victim; while evicted slots still wait for readers the engine is
told nothing and asks again), which
publishes the key as being stored in the shared index, and has the tier read the block into
that slot on its own threads. When the read ends, the key becomes ready (engines read HIT
through the index, no extra message) or, if it failed (missing, corrupt, an I/O error), is
removed (engines read MISS). A read that outlives PROMOTE_DEADLINE_S is given up: the key is
removed at once and its slot kept out of use until the read really ends, so a slow tier
costs MISSes, never a request stuck waiting or a slot written behind a new owner's back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvd_server.errors import NotFound
from kvd_server.tiers.base import Tier, TierKey, succeeded
from kvd_server.tiers.below_table import BelowTables
from kvd_server.tiers.loop_inbox import LoopInbox

if TYPE_CHECKING:
    from kvd_server.core.namespaces import Namespace, NamespaceTable
    from kvd_server.memory.tenant_pools import TenantPools

log = logging.getLogger(__name__)

PROMOTE_DEADLINE_S = 10.0
MAX_OPEN_PROMOTIONS = 4096       # reads in flight at once, over every namespace
WAIT_FOR_SLOTS_S = 0.05          # slots promotions wait for are kept from reserves this long


@dataclass(slots=True, eq=False)
class Promotion:
    ns_id: str
    key: bytes
    slot: int
    epoch: int
    dest: memoryview
    held: list[int] = field(default_factory=list)    # slots kept until a late read ends
    late: bool = False


class Promoter:
    """Promotions from one tier into the pool (see the module doc); runs on the event loop."""

    def __init__(self, tier: Tier, namespaces: NamespaceTable, pools: TenantPools,
                 tables: BelowTables, loop: asyncio.AbstractEventLoop,
                 refusing: Callable[[], bool] = lambda: False) -> None:
        """`refusing`: whether the daemon takes no new blocks now (draining)."""
        self.tier = tier
        self._namespaces = namespaces
        self._pools = pools
        self._tables = tables
        self._loop = loop
        self._refusing = refusing
        self._open: dict[tuple[str, bytes], Promotion] = {}
        self._finished: LoopInbox[tuple[Promotion, bool]] = LoopInbox(loop, self._done_all)
        self.refused_total = 0
        self.late_total = 0

    @property
    def open(self) -> int:
        return len(self._open)

    def promote(self, ns: Namespace, keys: Sequence[bytes], prefix: bool = False
                ) -> set[bytes]:
        """Start promoting the keys of `ns` held below and not in the pool (`prefix`: up to
        the first key held nowhere); the keys being promoted now (started by this call or
        before)."""
        table = self._tables.get(ns.id)
        started: set[bytes] = set()
        if table is None:
            return started
        if not self.tier.readable:               # reads fail (a dead disk): name nothing, so
            self._tables.clear_all()             # engines read MISS at once (TierLink.tick
            return started                       # names it all again once reads work)
        mgr = ns.mgr
        wanted: list[TierKey] = []
        for key in dict.fromkeys(keys):          # a key asked twice is promoted once
            if (ns.id, key) in self._open:
                started.add(key)
                continue
            if mgr.table.find(key) >= 0:
                continue
            if key not in table:
                if prefix:
                    break
                continue
            tier_key = TierKey(ns.id, key, ns.tenant)
            if not self.tier.contains(tier_key):
                table.discard(key)              # a stale name (or a shared fingerprint)
                continue
            wanted.append(tier_key)
        room = MAX_OPEN_PROMOTIONS - len(self._open)
        if self._refusing() or room <= 0:
            self.refused_total += len(wanted)
            return started
        if len(wanted) > room:
            self.refused_total += len(wanted) - room
            del wanted[room:]
        if wanted and ns.slots.free_count() < len(wanted):
            # Room for all of them at once (slots waiting for readers count: they come back
            # at the engines' next steps, when it asks again), none evicted among them.
            mgr.make_room(len(wanted), [k.key for k in wanted])
        begun = self._start_all(ns, wanted)
        started.update(begun)
        waiting = len(wanted) - len(begun)
        # The slots evicted for the ones that got none come free at the engines' next steps:
        # kept for them (not handed to reserves) while the engine asks again.
        ns.promotions_waiting = waiting
        ns.promotions_waiting_until = time.monotonic() + WAIT_FOR_SLOTS_S
        return started

    def _start_all(self, ns: Namespace, wanted: list[TierKey]) -> list[bytes]:
        """Start the reads of `wanted` (distinct keys, none in the pool): the slots of as many
        as are free taken in one store decision, one view of the pool, one deadline timer;
        the keys started. The rest wait for slots (the engine asks again)."""
        mgr = ns.mgr
        n = min(len(wanted), ns.slots.free_count())
        self.refused_total += len(wanted) - n     # their slots wait for readers
        if not n:
            return []
        grant = mgr.prepare_store([k.key for k in wanted[:n]])
        if grant is None or not grant.keys_to_store:
            self.refused_total += n
            return []
        by_key = {k.key: k for k in wanted[:n]}
        self.refused_total += n - len(grant.keys_to_store)
        epoch = mgr.epoch
        started: list[Promotion] = []
        lost: list[TierKey] = []
        failed: list[bytes] = []
        with self._pools.for_tenant(ns.tenant).view() as pool:
            for key, slot in zip(grant.keys_to_store, grant.slots, strict=True):
                start = ns.slots.offset(slot)
                dest = pool[start:start + ns.slots.stride]   # the whole slot: aligned reads
                tier_key = by_key[key]
                future = self.tier.promote(tier_key, dest)
                if future is None:                   # dropped meanwhile
                    dest.release()
                    failed.append(key)
                    lost.append(tier_key)
                    continue
                p = Promotion(ns.id, key, slot, epoch, dest)
                self._open[(ns.id, key)] = p
                started.append(p)
                future.add_done_callback(lambda f, _p=p: self._done_async(_p, f))
        if failed:
            mgr.complete_store(failed, False, epoch=epoch)
            self._tables.lost(lost)
        if started:                     # one deadline for the batch (done ones are skipped)
            self._loop.call_later(PROMOTE_DEADLINE_S, self._late_all, started)
        return [p.key for p in started]

    def _done_async(self, p: Promotion, future: Future[bool]) -> None:
        self._finished.put((p, succeeded(future)))

    def _done_all(self, finished: list[tuple[Promotion, bool]]) -> None:
        """The reads that ended since the last call (on the event loop): each namespace told
        once per epoch and outcome, not once per key."""
        groups: dict[tuple[str, int, bool], list[bytes]] = {}
        for p, ok in finished:
            try:
                if self._finish(p):
                    groups.setdefault((p.ns_id, p.epoch, ok), []).append(p.key)
            except Exception:  # one promotion's bug must not strand the others
                log.exception("finishing a promotion failed")
        for (ns_id, epoch, ok), keys in groups.items():
            try:
                ns = self._ns(ns_id)
                if ns is not None:
                    ns.mgr.complete_store(keys, ok, epoch=epoch)
                if not ok:
                    self._tables.lost([TierKey(ns_id, key) for key in keys])
            except Exception:
                log.exception("finishing %d promotions failed", len(keys))

    def _ns(self, ns_id: str) -> Namespace | None:
        try:
            return self._namespaces.get(ns_id)
        except NotFound:
            return None

    def _finish(self, p: Promotion) -> bool:
        """A read ended: its slot view let go; whether the promotion is still open (one given
        up already only gives its held slots back)."""
        p.dest.release()
        if p.late:                               # given up already: its slot comes back now
            ns = self._ns(p.ns_id)
            if ns is not None:
                for slot in p.held:
                    ns.slots.free(slot)
            return False
        del self._open[(p.ns_id, p.key)]
        return True

    def _late_all(self, batch: list[Promotion]) -> None:
        for p in batch:
            self._late(p)

    def _late(self, p: Promotion) -> None:
        """The read outlived its deadline: the key is a MISS from now on; the slot waits."""
        if self._open.get((p.ns_id, p.key)) is not p:
            return
        del self._open[(p.ns_id, p.key)]
        p.late = True
        self.late_total += 1
        log.warning("promotion from the %s tier took over %.0fs; given up (the key reads "
                    "MISS)", self.tier.name, PROMOTE_DEADLINE_S)
        ns = self._ns(p.ns_id)
        if ns is not None:
            ns.mgr.complete_store([p.key], False, epoch=p.epoch, hold=p.held)
