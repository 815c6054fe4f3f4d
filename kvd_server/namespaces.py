"""Namespaces: which engines may share blocks, and the pool extents each one holds.

A namespace is model identity + KV layout + salt + tenant (the digest `namespace_id`); it owns
one `NamespaceManager` (the block index) over a `NamespaceSlots` (its extents cut into slots).
Tenants' extent budgets (quotas) and the quarantine of slots a dead writer may still touch
live here too, since both are about who holds which part of the pool. Pure logic, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvd_proto.wire import KvLayout
from kvd_server.config import TenantsConfig
from kvd_server.errors import InvalidArgument, NotFound, ResourceExhausted
from kvd_server.extents import ExtentAllocator, NamespaceSlots, TenantBudget
from kvd_server.manager import NamespaceManager
from kvd_server.manager.requests import RecencyBudget
from kvd_server.shm_index import Reclamation, ShmIndex

MAX_NAMESPACES = 1024
# Keys all open requests of all namespaces may record for recency (see RecencyBudget): about
# 200 bytes each, so the daemon's request bookkeeping stays under ~800 MB whatever clients do.
MAX_RECORDED_KEYS = 4 << 20


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
    # Its sessions' reserves (kvd_server/fastpath.py keeps them): slots they asked to hold
    # granted, and how many of those they do not hold yet.
    reserve_targets: int = 0
    reserve_owed: int = 0
    lookups_total: int = 0
    hits_total: int = 0
    misses_total: int = 0

    @property
    def epoch(self) -> int:
        return self.mgr.epoch


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


class NamespaceTable:
    """Every namespace of the daemon and the tenants' extent budgets."""

    def __init__(self, extents: ExtentAllocator, policy: str, tenants: TenantsConfig) -> None:
        self.extents = extents
        self.policy = policy
        self.tenants = tenants
        self._namespaces: dict[str, Namespace] = {}
        self._budgets: dict[str, TenantBudget] = {}     # tenant -> its extent quota
        self.recency = RecencyBudget(MAX_RECORDED_KEYS)

    def __iter__(self) -> Iterator[Namespace]:
        return iter(self._namespaces.values())

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
        return ns

    def leave(self, ns: Namespace) -> None:
        ns.sessions -= 1
        self.maybe_release(ns)

    def _create(self, ns_id: str, model: str, layout: KvLayout, salt: str,
                tenant: str) -> Namespace:
        if len(self._namespaces) >= MAX_NAMESPACES:
            self._collect()
            if len(self._namespaces) >= MAX_NAMESPACES:
                raise ResourceExhausted(f"{MAX_NAMESPACES} namespaces exist already")
        try:
            slots = NamespaceSlots(self.extents, layout.block_bytes, budget=self.budget(tenant),
                                   reclaimer=self._reclaim)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        index = ShmIndex(self.extents.total * slots.per_extent, layout.index_key_width,
                         slots.per_extent, slots.stride, self.extents.extent_bytes,
                         name=f"kvd-index-{ns_id[:12]}")
        reclaim = Reclamation(index)
        slots.limbo = reclaim
        ns = Namespace(ns_id, model, layout, salt, tenant, slots,
                       NamespaceManager(slots, self.policy, budget=self.recency, index=index),
                       index, reclaim)
        self._namespaces[ns_id] = ns
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

    def _collect(self) -> None:
        """Forget namespaces nobody uses that hold nothing."""
        for ns_id in [i for i, ns in self._namespaces.items()
                      if ns.sessions == 0 and ns.mgr.is_empty() and not ns.slots.in_use]:
            ns = self._namespaces.pop(ns_id)
            ns.slots.release_extents()
            if ns.reclaim is not None:
                ns.reclaim.close()
            if ns.index is not None:
                ns.index.close()

    def _reclaim(self, asking: NamespaceSlots, n: int) -> bool:
        """Fair share of a full pool: a namespace that needs room and holds fewer extents than
        its share (the pool's extents over the active namespaces: those with sessions or
        blocks) takes whole extents from the namespace furthest above its share, evicting the
        blocks in them; the least occupied extent whose blocks are all evictable goes first.
        A namespace at or above its share evicts its own blocks instead (its policy decides).
        Tenant quotas still apply to the taker."""
        if self.extents.free_extents() or (asking.budget is not None
                                           and asking.budget.room(1) == 0):
            return False
        active = [ns for ns in self._namespaces.values()
                  if ns.sessions or not ns.mgr.is_empty()]
        share = self.extents.total // max(1, len(active))
        wanted = -(-n // asking.per_extent)
        got = 0
        tried: set[str] = set()
        while got < wanted and asking.extents_held() < share:
            victims = [ns for ns in active if ns.slots is not asking and ns.id not in tried
                       and ns.slots.extents_held() > share]
            if not victims:
                break
            victim = max(victims, key=lambda ns: ns.slots.extents_held())
            if self._take_extent(victim):
                got += 1
            else:
                tried.add(victim.id)       # every extent of it is busy (pinned, storing)
        return got > 0

    @staticmethod
    def _take_extent(victim: Namespace) -> bool:
        """Empty one extent of `victim` (evicting its blocks) and give it back to the pool."""
        slots = victim.slots
        for extent in sorted(slots.held(), key=slots.used_in):
            resident = victim.mgr.resident_slots(slots.slots_in(extent))
            if len(resident) != slots.used_in(extent):
                continue       # zombies or held slots in it: not now
            if victim.mgr.evict_slots(resident):
                slots.release_extent(extent)
                return True
        return False

    @staticmethod
    def maybe_release(ns: Namespace) -> None:
        """Give an empty namespace's extents back to the pool."""
        if ns.slots.extents_held() and ns.mgr.is_empty():
            ns.slots.collect()
            ns.slots.release_extents()


@dataclass(slots=True)
class Held:
    """What an ended session still holds because its process lives on."""

    ns: Namespace
    session_id: str
    pid: int
    since: float
    slots: list[int]                    # slots of unfinished stores it may still be writing
    pins: list[tuple[int, bytes]]       # (epoch, key) refs of blocks it may still be reading
    reader: bool = False                # its published index epoch still holds back reuse


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

    def hold(self, held: Held) -> None:
        if held.slots or held.pins or held.reader:
            self._held.append(held)

    def release_due(self) -> None:
        """Give back what processes that are gone held."""
        keep: list[Held] = []
        for q in self._held:
            if self.alive(q.pid):
                keep.append(q)
            else:
                self.release(q)
        self._held = keep

    def release_session(self, session_id: str, pid: int) -> tuple[int, int] | None:
        """Give back what the ended session `session_id` of process `pid` held, at the word of
        a later session of that process; (pins, slots) released, None if none such is held."""
        for i, q in enumerate(self._held):
            if q.session_id == session_id and q.pid == pid:
                del self._held[i]
                self.release(q)
                return len(q.pins), len(q.slots)
        return None

    @staticmethod
    def release(q: Held) -> None:
        """Give back one session's holdings to its namespace."""
        for epoch, key in q.pins:
            q.ns.mgr.unpin(key, epoch)
        for slot in q.slots:
            q.ns.slots.free(slot)
        if q.reader and q.ns.reclaim is not None:
            q.ns.reclaim.release_reader(q.session_id)
        NamespaceTable.maybe_release(q.ns)

    def __bool__(self) -> bool:
        return bool(self._held)

    def slots_held(self) -> int:
        return sum(len(q.slots) for q in self._held)

    def pins_held(self) -> int:
        return sum(len(q.pins) for q in self._held)


def pid_alive(pid: int) -> bool:
    """Whether `pid` may still run (and so still write through its mapping of the pool).

    0 (a peer in another pid namespace) is unknown: assumed alive. A zombie has no mappings.
    """
    if pid <= 0:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")
