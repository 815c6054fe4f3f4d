"""Namespaces: which engines may share blocks, and the pool extents each one holds.

A namespace is model identity + KV layout + salt + tenant (the digest `namespace_id`); it owns
one `NamespaceManager` (the block index) over a `NamespaceSlots` (its extents cut into slots).
Tenants' extent budgets (quotas) and the quarantine of slots a dead writer may still touch
live here too, since both are about who holds which part of the pool. Pure logic, no I/O.

A namespace costs memory while it exists even when it holds no block: its shared index is
sized for the whole pool (slots x (key width + 16) bytes: 36 MiB for a 1 GiB pool of 4 KiB
blocks with 128-byte keys), and engines that map it and exit leave it to the daemon. So one
with no session and no block is forgotten at the sweep after its last session ended (once no
reader's process may still read its slots; `tenants.namespace_idle_timeout` may delay it), and
a tenant holds at most `tenants.max_namespaces` of them and `tenants.max_index_memory` bytes of
their indexes.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from kvd_proto.index_layout import Header, buckets_for
from kvd_proto.wire import KvLayout
from kvd_server.config import TenantsConfig
from kvd_server.core.peer import process_start, same_process
from kvd_server.errors import InvalidArgument, NotFound, ResourceExhausted
from kvd_server.manager import NamespaceManager
from kvd_server.manager.requests import RecencyBudget
from kvd_server.memory.extents import (
    ExtentAllocator,
    NamespaceSlots,
    TenantBudget,
    slot_geometry,
)
from kvd_server.memory.shm_index import Reclamation, ShmIndex
from kvd_server.units import format_duration, format_size

log = logging.getLogger(__name__)

MAX_NAMESPACES = 1024                   # daemon-wide; tenants.max_namespaces is per tenant
# Keys all open requests of all namespaces may record for recency (see RecencyBudget): about
# 200 bytes each, so the daemon's request bookkeeping stays under ~800 MB whatever clients do.
MAX_RECORDED_KEYS = 4 << 20


class ReserveHolder(Protocol):
    """A session's side of its reserve (kvd_server/core/sessions.py): the slots it holds
    granted for stores it will decide itself, and how many it wants to hold."""

    granted: set[int]
    reserve_target: int


def reserve_owed(holder: ReserveHolder) -> int:
    """Slots promised to the holder's reserve that it does not hold yet."""
    return max(0, holder.reserve_target - len(holder.granted))


@dataclass(slots=True)
class Namespace:
    id: str
    model: str
    layout: KvLayout
    salt: str
    tenant: str
    slots: NamespaceSlots
    mgr: NamespaceManager
    index: ShmIndex | None = None
    reclaim: Reclamation | None = None
    sessions: int = 0
    # Its sessions' reserves (carried here by `carry_reserve` as each changes): slots they
    # asked to hold granted, and how many of those they do not hold yet.
    reserve_targets: int = 0
    reserve_owed: int = 0
    lookups_total: int = 0
    hits_total: int = 0
    misses_total: int = 0
    idle_since: float | None = None     # when it was first seen with no session and no block
    # Slots promotions from a tier below wait for (kvd_server/tiers/promotion.py), until when:
    # reserves are not topped up from those (they would take every slot as it comes free).
    promotions_waiting: int = 0
    promotions_waiting_until: float = 0.0

    @property
    def epoch(self) -> int:
        return self.mgr.epoch

    def free_for_reserves(self) -> int:
        """Free slots the sessions' reserves may take now (not those promotions wait for)."""
        free = self.slots.free_count()
        if self.promotions_waiting and time.monotonic() < self.promotions_waiting_until:
            return max(0, free - self.promotions_waiting)
        return free

    def carry_reserve(self, holder: ReserveHolder, target: int, owed: int) -> None:
        """Carry a change of `holder`'s reserve (from `target`, `owed` before it) to the
        namespace's figures, so that no call scans the sessions."""
        self.reserve_targets += holder.reserve_target - target
        self.reserve_owed += reserve_owed(holder) - owed
        # The policy's capacity (ARC bounds its target and ghost lists by it) is what blocks
        # may hold: the namespace's slots less its sessions' reserves.
        self.mgr.policy.capacity = max(1, self.slots.capacity() - self.reserve_targets)

    def end_reserve(self, holder: ReserveHolder) -> list[int]:
        """`holder` ends: its reserve leaves the namespace's figures; the slots it held
        granted (which it may have started writing into) are the caller's."""
        slots = list(holder.granted)
        before = (holder.reserve_target, reserve_owed(holder))
        holder.reserve_target = 0
        holder.granted.clear()
        self.carry_reserve(holder, *before)
        return slots

    @property
    def unused(self) -> bool:
        """No session, no block, no slot in use (granted, held or in limbo) and no ended
        reader whose process lives on (the readers' grace: it may still act on what it read):
        forgetting it loses nothing but its counters."""
        return (not self.sessions and self.mgr.is_empty() and not self.slots.in_use
                and not (self.reclaim is not None and self.reclaim.held))

    def settle(self) -> bool:
        """Whether it is unused, once the freed slots every reader has moved past are back
        (they count as in use while in limbo): an empty namespace is not kept a sweep
        longer for them."""
        if not self.sessions and self.slots.in_use and self.mgr.is_empty():
            self.slots.collect()
        return self.unused

    @property
    def index_bytes(self) -> int:
        """The shared memory its index takes (whole file: engines that read it fault every
        page in)."""
        return self.index.header.file_bytes if self.index is not None else 0

    def release_extents(self) -> None:
        """Give its extents back to the pool when it holds no block (after whatever may have
        emptied it: a reset, the end of a session, a lease or a load), so that other
        namespaces may grow; nothing while any slot is in use (granted, held, in limbo)."""
        if self.slots.extents_held() and self.mgr.is_empty():
            self.slots.collect()
            self.slots.release_extents()

    def close(self) -> int:
        """It is forgotten (unused): its extents go back to the pool, its reclamation and
        index close; the index's bytes given back."""
        self.slots.closed = True         # an extent draining for it goes to the pool
        self.slots.release_extents()
        if self.reclaim is not None:
            self.reclaim.close()
        if self.index is None:
            return 0
        freed = self.index.header.file_bytes
        self.index.close()
        return freed


def namespace_id(model: str, layout: KvLayout, salt: str, tenant: str) -> str:
    """Digest of everything that must match for two engines to share blocks.

    Each part is length-prefixed, so the encoding is injective whatever bytes the parts hold
    (two different identities can never join into one namespace).
    """
    h = hashlib.sha256(b"kvd-namespace-v2")
    for part in (model, str(layout.block_bytes), str(layout.num_ranks), str(layout.shard_bytes),
                 str(layout.tokens_per_block), layout.dtype, salt, tenant,
                 str(layout.index_key_width)):
        data = part.encode()
        h.update(len(data).to_bytes(4, "big"))
        h.update(data)
    return h.hexdigest()[:32]


class NamespaceFiles(Protocol):
    """Where namespaces' indexes live when they must outlive the daemon (warm restart,
    kvd_server/restart/warm.py), told of namespaces as they come and go."""

    def index(self, ns_id: str, capacity: int, key_width: int, per_extent: int, stride: int,
              extent_bytes: int) -> ShmIndex: ...

    def policy_memory(self, ns_id: str, nbytes: int, *, adopt: bool) -> object | None: ...

    def created(self, ns: Namespace) -> None: ...

    def forgotten(self, ns: Namespace) -> None: ...


class NamespaceTable:
    """Every namespace of the daemon and the tenants' extent budgets."""

    def __init__(self, extents: ExtentAllocator, policy: str, tenants: TenantsConfig, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.extents = extents
        self.policy = policy
        self.tenants = tenants
        self.clock = clock
        self.files: NamespaceFiles | None = None     # warm restart: indexes in files
        self.on_made: list[Callable[[Namespace], None]] = []   # e.g. a tier joins each
        self.on_forgotten: list[Callable[[Namespace], None]] = []
        self._namespaces: dict[str, Namespace] = {}
        self._budgets: dict[str, TenantBudget] = {}     # tenant -> its extent quota
        self.recency = RecencyBudget(MAX_RECORDED_KEYS)
        self.forgotten_total = 0
        # tenant -> new namespaces refused for tenants.max_index_memory
        self.index_refused: Counter[str] = Counter()

    def __iter__(self) -> Iterator[Namespace]:
        return iter(list(self._namespaces.values()))

    def __len__(self) -> int:
        return len(self._namespaces)

    def get(self, ns_id: str) -> Namespace:
        ns = self._namespaces.get(ns_id)
        if ns is None:
            raise NotFound(f"no namespace {ns_id!r} (see `kvd stats`)")
        return ns

    def join(self, model: str, layout: KvLayout, salt: str, tenant: str) -> Namespace:
        """The namespace of (model, layout, salt, tenant), created on first use; counts one
        more session in it."""
        ns_id = namespace_id(model, layout, salt, tenant)
        ns = self._namespaces.get(ns_id)
        if ns is None:
            ns = self._create(ns_id, model, layout, salt, tenant)
        ns.sessions += 1
        ns.idle_since = None
        return ns

    def leave(self, ns: Namespace) -> None:
        """One session of `ns` ended; once it holds nothing the next sweep forgets it
        (`collect_idle`)."""
        ns.sessions -= 1
        ns.release_extents()

    def _create(self, ns_id: str, model: str, layout: KvLayout, salt: str,
                tenant: str) -> Namespace:
        limit = self.tenants.max_namespaces
        if self._count(tenant) >= limit:
            self._collect(tenant)
            held = self._count(tenant)
            if held >= limit:
                raise ResourceExhausted(
                    f"tenant {tenant!r} has {held} namespaces, its limit (tenants.max_namespaces"
                    f" = {limit}); end the sessions of models and layouts it no longer uses and "
                    f"drop their blocks (kvd reset --namespace ID), or raise "
                    f"tenants.max_namespaces")
        if len(self._namespaces) >= MAX_NAMESPACES:
            self._collect()
            if len(self._namespaces) >= MAX_NAMESPACES:
                raise ResourceExhausted(f"{MAX_NAMESPACES} namespaces exist already (the "
                                        f"daemon's limit, whatever the tenant)")
        self._check_index_memory(tenant, layout)
        ns = self.make(ns_id, model, layout, salt, tenant)
        if self.files is not None:
            self.files.created(ns)
        return ns

    def _check_index_memory(self, tenant: str, layout: KvLayout) -> None:
        """Refuse a new namespace whose index would take `tenant` past
        `tenants.max_index_memory` (after forgetting its unused ones): the bytes, not only the
        count, since one index grows with the pool and shrinks with the block size."""
        limit = self.tenants.max_index_memory
        if not limit:
            return
        try:
            need = self.index_bytes_for(layout)
        except ValueError:
            return                       # `make` refuses the layout, saying why
        held = self.index_bytes(tenant)
        if held + need > limit:
            self._collect(tenant)
            held = self.index_bytes(tenant)
        if held + need <= limit:
            return
        self.index_refused[tenant] += 1
        raise ResourceExhausted(
            f"tenant {tenant!r} holds {format_size(held)} of namespace indexes in shared "
            f"memory, and this namespace's index needs {format_size(need)} more: past its "
            f"limit (tenants.max_index_memory = {format_size(limit)}); end the sessions of "
            f"models and layouts it no longer uses and drop their blocks (kvd reset "
            f"--namespace ID), use larger blocks or shorter keys (an index is sized for the "
            f"whole pool), or raise tenants.max_index_memory")

    def index_bytes_for(self, layout: KvLayout) -> int:
        """The bytes of a new index for `layout` (sized for the whole pool); ValueError when
        a block does not fit one extent."""
        stride, per_extent = slot_geometry(self.extents.extent_bytes, layout.block_bytes)
        capacity = self.extents.total * per_extent
        return Header(capacity=capacity, buckets=buckets_for(capacity),
                      key_width=layout.index_key_width, per_extent=per_extent, stride=stride,
                      extent_bytes=self.extents.extent_bytes).file_bytes

    def index_bytes(self, tenant: str) -> int:
        """The shared memory `tenant`'s namespaces' indexes take now."""
        return sum(ns.index_bytes for ns in self._namespaces.values() if ns.tenant == tenant)

    def make(self, ns_id: str, model: str, layout: KvLayout, salt: str, tenant: str, *,
             index: ShmIndex | None = None) -> Namespace:
        """A namespace in the table over a new index (or `index`: one a warm restart adopts,
        whose blocks the caller adopts next)."""
        try:
            slots = NamespaceSlots(self.extents, layout.block_bytes, budget=self.budget(tenant),
                                   reclaimer=self._reclaim)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        adopting = index is not None
        if index is None:
            geometry = (self.extents.total * slots.per_extent, layout.index_key_width,
                        slots.per_extent, slots.stride, self.extents.extent_bytes)
            index = self.files.index(ns_id, *geometry) if self.files is not None else \
                ShmIndex(*geometry, name=f"kvd-index-{ns_id[:12]}")
        # Warm restart: the policy's order lives beside the index (LRU's ranks), then the
        # retained blocks' words (manager/retention.py): 8 bytes a slot each.
        memory = self.files.policy_memory(ns_id, 16 * index.header.capacity, adopt=adopting) \
            if self.files is not None else None
        reclaim = Reclamation(index)
        slots.limbo = reclaim
        ns = Namespace(ns_id, model, layout, salt, tenant, slots,
                       NamespaceManager(slots, self.policy, budget=self.recency, index=index,
                                        policy_memory=memory),
                       index, reclaim)
        self._namespaces[ns_id] = ns
        for hook in self.on_made:
            hook(ns)
        return ns

    def budget(self, tenant: str) -> TenantBudget:
        budget = self._budgets.get(tenant)
        if budget is None:
            quota = self.tenants.quota_of(tenant)
            budget = TenantBudget(tenant, max(1, quota // self.extents.extent_bytes)
                                  if quota else None)
            self._budgets[tenant] = budget
        return budget

    def budgets(self) -> Iterator[TenantBudget]:
        return iter(self._budgets.values())

    def _count(self, tenant: str) -> int:
        return sum(1 for ns in self._namespaces.values() if ns.tenant == tenant)

    def _collect(self, tenant: str | None = None) -> None:
        """Forget namespaces nobody uses that hold nothing (of `tenant`, or all), idle or not:
        a new namespace needs their place."""
        self._forget([ns for ns in self._namespaces.values()
                      if (tenant is None or ns.tenant == tenant) and ns.settle()])

    def collect_idle(self) -> int:
        """Forget the namespaces unused (no session, no block, no reader's grace) for
        `tenants.namespace_idle_timeout` (by default none: at the sweep after their last
        session ended), so that their index memory goes back to the system; how many. Engines
        that mapped an index keep their own mapping of it: its pages go once they unmap it.
        A delay would spare an engine that restarts at once a new index (and its stats their
        counters), at the cost of the memory of every namespace an engine left."""
        now = self.clock()
        timeout = self.tenants.namespace_idle_timeout
        idle = []
        for ns in self._namespaces.values():
            if not ns.settle():
                ns.idle_since = None
                continue
            if ns.idle_since is None:
                ns.idle_since = now
            if now - ns.idle_since >= timeout:
                idle.append(ns)
        if idle:
            freed = self._forget(idle)
            after = f"for {format_duration(timeout)}" if timeout else "once their last " \
                "session ended"
            log.info("forgot %d namespaces with no session and no block %s: closed their "
                     "indexes (%s of shared memory)", len(idle), after, format_size(freed))
        return len(idle)

    def _forget(self, gone: list[Namespace]) -> int:
        """Drop `gone` (all unused) and close their indexes; the index bytes given back."""
        freed = 0
        for ns in gone:
            del self._namespaces[ns.id]
            freed += ns.close()
            if self.files is not None:
                self.files.forgotten(ns)
            for hook in self.on_forgotten:
                hook(ns)
            self.forgotten_total += 1
        return freed

    def _reclaim(self, asking: NamespaceSlots, n: int) -> bool:
        """Fair share of a full pool: a namespace that needs room and holds fewer extents than
        its share (the pool's extents over the active namespaces: those with sessions or
        blocks) takes whole extents from the namespace furthest above its share, evicting the
        blocks in them; the least occupied extent whose blocks are all evictable goes first.
        A namespace at or above its share evicts its own blocks instead (its policy decides).
        Tenant quotas still apply to the taker.

        An extent whose evicted slots wait in limbo (engines reading the victim's index may
        still copy out of them) drains first and reaches the taker once they are released
        (NamespaceSlots.drain): the taker gets what is free now (maybe nothing: "cannot
        store", a smaller grant) and asks again; extents already draining for it count as
        taken, so its retries evict nothing more. True when the taker's room grew."""
        held = asking.extents_held()
        if asking.incoming:
            for ns in self._namespaces.values():
                if ns.slots.draining():
                    ns.slots.collect()     # a drained extent goes to its taker
            if asking.extents_held() > held:
                return True
        budget = asking.budget
        if self.extents.free_extents() or (budget is not None and budget.max_extents is not None
                                           and budget.held + asking.incoming
                                           >= budget.max_extents):
            return False
        active = [ns for ns in self._namespaces.values()
                  if ns.sessions or not ns.mgr.is_empty()]
        share = self.extents.total // max(1, len(active))
        wanted = -(-n // asking.per_extent) - asking.incoming
        got = 0
        tried: set[str] = set()
        while got < wanted and asking.extents_held() + asking.incoming < share:
            victims = [ns for ns in active if ns.slots is not asking and ns.id not in tried
                       and ns.slots.extents_held() - ns.slots.draining() > share]
            if not victims:
                break
            victim = max(victims, key=lambda ns: ns.slots.extents_held() - ns.slots.draining())
            if self._take_extent(victim, asking):
                got += 1
            else:
                tried.add(victim.id)       # every extent of it is busy (pinned, storing)
        return asking.extents_held() > held or self.extents.free_extents() > 0

    @staticmethod
    def _take_extent(victim: Namespace, taker: NamespaceSlots) -> bool:
        """Empty one extent of `victim` (evicting its blocks) for `taker`: back to the pool
        now, or once its slots leave limbo (then straight to `taker`)."""
        slots = victim.slots
        slots.collect()
        candidates = [e for e in slots.held() if not slots.is_draining(e)]
        for extent in sorted(candidates, key=lambda e: slots.used_in(e) - slots.retired_in(e)):
            resident = victim.mgr.resident_slots(slots.slots_in(extent))
            if len(resident) + slots.retired_in(extent) != slots.used_in(extent):
                continue       # zombies, granted or held slots in it: not now
            if victim.mgr.evict_slots(resident):
                slots.drain(extent, taker)
                return True
        return False


@dataclass(slots=True)
class Held:
    """What an ended session still holds because its process lives on."""

    ns: Namespace
    session_id: str
    pid: int
    since: float
    slots: list[int]                    # slots of unfinished stores it may still be writing
    refs: list[tuple[int, bytes]]       # (epoch, key) of its load pins and lookup leases:
                                        # blocks it may still be reading
    reader: bool = False                # its published index epoch still holds back reuse
    start: int = 0                      # its process's start time (0: unknown, pid alone)


class SlotQuarantine:
    """Pins and store slots of sessions that ended while their process still runs.

    A session whose stream closed or that was reaped for silence may belong to a process that
    is only stopped or slow: its workers can still copy out of the blocks it pinned or leased
    and into the slots it was granted. Until that process is gone, or a later session of the
    same process says its copies are done (ReleaseHeld), those blocks stay pinned and those
    slots stay out of use, so no such copy ever touches a slot that holds another key. What a
    session can hold is bounded (its pins, leases and pending stores), so this is too.
    """

    def __init__(self, alive: Callable[[int], bool]) -> None:
        self.alive = alive
        self._held: list[Held] = []

    def _lives(self, q: Held) -> bool:
        """Whether `q`'s process still runs: with its start time known, that very process
        (a reused pid is another one)."""
        if q.start:
            return same_process(q.pid, q.start)
        return self.alive(q.pid)

    def holds(self, session_id: str, pid: int | None = None) -> bool:
        """Whether what the ended session `session_id` (of process `pid`) held is held."""
        return any(q.session_id == session_id and (pid is None or q.pid == pid)
                   for q in self._held)

    def hold(self, held: Held) -> None:
        if held.slots or held.refs or held.reader:
            self._held.append(held)

    def release_due(self) -> None:
        """Give back what processes that are gone held."""
        keep: list[Held] = []
        for q in self._held:
            if self._lives(q):
                keep.append(q)
            else:
                self.release(q)
        self._held = keep

    def release_session(self, session_id: str, pid: int) -> tuple[int, int] | None:
        """Give back what the ended session `session_id` of process `pid` held, at the word of
        a later session of that process; (pins and leases, slots) released, None if none such
        is held."""
        for i, q in enumerate(self._held):
            if q.session_id == session_id and q.pid == pid:
                del self._held[i]
                self.release(q)
                return len(q.refs), len(q.slots)
        return None

    @staticmethod
    def release(q: Held) -> None:
        """Give back one session's holdings to its namespace."""
        mgr = q.ns.mgr
        for epoch, key in q.refs:         # a pin or a lease: one ref, released alike
            mgr.complete_load((key,), None, epoch)
        for slot in q.slots:
            q.ns.slots.free(slot)
        if q.reader and q.ns.reclaim is not None:
            q.ns.reclaim.release_reader(q.session_id)
        q.ns.release_extents()

    def __bool__(self) -> bool:
        return bool(self._held)

    def slots_held(self) -> int:
        return sum(len(q.slots) for q in self._held)

    def refs_held(self) -> int:
        """Load pins and lookup leases ended sessions hold (blocks they may still read)."""
        return sum(len(q.refs) for q in self._held)


def pid_alive(pid: int) -> bool:
    """Whether `pid` may still run (and so still write through its mapping of the pool).

    0 (a peer in another pid namespace) is unknown: assumed alive. A zombie has no mappings.
    A process /proc hides from the daemon (systemd's ProtectProc=invisible) is alive if the
    kernel says it exists.
    """
    if pid <= 0:
        return True
    return process_start(pid) != 0
