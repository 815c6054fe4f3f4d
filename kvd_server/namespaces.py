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

MAX_NAMESPACES = 1024
# A slot whose writer's session ended mid-store stays out of use while that writer may still be
# copying into it (a stalled engine resumes and finishes its write): until its process is gone
# and a grace period passed, or at most this long.
QUARANTINE_MAX_S = 600.0


@dataclass(slots=True)
class Namespace:
    id: str
    model: str
    layout: KvLayout
    salt: str
    tenant: str
    slots: NamespaceSlots
    mgr: NamespaceManager
    sessions: int = 0
    lookups_total: int = 0
    hits_total: int = 0
    misses_total: int = 0

    @property
    def epoch(self) -> int:
        return self.mgr.epoch


def namespace_id(model: str, layout: KvLayout, salt: str, tenant: str) -> str:
    """Digest of everything that must match for two engines to share blocks."""
    h = hashlib.sha256()
    for part in (model, str(layout.block_bytes), str(layout.num_ranks), str(layout.shard_bytes),
                 str(layout.tokens_per_block), layout.dtype, salt, tenant):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


class NamespaceTable:
    """Every namespace of the daemon and the tenants' extent budgets."""

    def __init__(self, extents: ExtentAllocator, policy: str, tenants: TenantsConfig) -> None:
        self.extents = extents
        self.policy = policy
        self.tenants = tenants
        self._namespaces: dict[str, Namespace] = {}
        self._budgets: dict[str, TenantBudget] = {}     # tenant -> its extent quota

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
            slots = NamespaceSlots(self.extents, layout.block_bytes, budget=self.budget(tenant))
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        ns = Namespace(ns_id, model, layout, salt, tenant, slots,
                       NamespaceManager(slots, self.policy))
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
            self._namespaces[ns_id].slots.release_extents()
            del self._namespaces[ns_id]

    @staticmethod
    def maybe_release(ns: Namespace) -> None:
        """Give an empty namespace's extents back to the pool."""
        if ns.slots.extents_held() and ns.mgr.is_empty():
            ns.slots.release_extents()


@dataclass(slots=True)
class _Held:
    ns: Namespace
    slots: list[int]
    pid: int
    since: float


class SlotQuarantine:
    """Slots of stores a dead session left unfinished, held while their writer may still run.

    A reaped session's process can be stopped or slow, not gone: its workers may still write
    into the slots it was granted. Those slots are reused only once `alive(pid)` says the
    process is gone (and a grace period passed), or after QUARANTINE_MAX_S.
    """

    def __init__(self, alive: Callable[[int], bool]) -> None:
        self._alive = alive
        self._held: list[_Held] = []

    def hold(self, ns: Namespace, slots: list[int], pid: int, now: float) -> None:
        if slots:
            self._held.append(_Held(ns, slots, pid, now))

    def release_due(self, now: float, grace: float) -> None:
        keep: list[_Held] = []
        for q in self._held:
            if now - q.since >= QUARANTINE_MAX_S or (now - q.since >= grace
                                                      and not self._alive(q.pid)):
                for slot in q.slots:
                    q.ns.slots.free(slot)
                NamespaceTable.maybe_release(q.ns)
            else:
                keep.append(q)
        self._held = keep

    def __bool__(self) -> bool:
        return bool(self._held)

    def slots_held(self) -> int:
        return sum(len(q.slots) for q in self._held)


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
