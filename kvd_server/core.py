"""The daemon's core: sessions, tenants, namespaces, leases and who owns which pin or store.

Pure logic on the event-loop thread (clock injected, no I/O). The gRPC service validates wire
bounds and calls these methods; the manager below keeps the block index of each namespace.
Ownership is strict: a session only ever releases its own pins and leases and completes its own
stores, so a buggy or hostile client cannot disturb another engine's state.
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvd_server import __version__
from kvd_server.attach import PeerCred
from kvd_server.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvd_server.extents import ExtentAllocator, NamespaceSlots, TenantBudget
from kvd_server.manager import Lookup, NamespaceManager, OffloadEvent

log = logging.getLogger(__name__)

MAX_NAMESPACES = 1024
MAX_LEASES_PER_SESSION = 65_536
MAX_OPEN_REQUESTS_PER_SESSION = 65_536
# A slot whose writer's session ended mid-store stays out of use while that writer may still be
# copying into it (a stalled engine resumes and finishes its write): until its process is gone
# and a grace period passed, or at most this long.
QUARANTINE_MAX_S = 600.0
DEFAULT_TENANT = "default"


class DaemonState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"


@dataclass(slots=True, frozen=True)
class EngineInfo:
    engine_id: str = ""
    engine_kind: str = ""
    engine_version: str = ""
    pid: int = 0
    hostname: str = ""


@dataclass(slots=True, frozen=True)
class Layout:
    block_bytes: int
    num_ranks: int
    shard_bytes: int
    tokens_per_block: int = 0
    dtype: str = ""


@dataclass(slots=True)
class TransferStats:
    load_bytes: int = 0
    load_seconds: float = 0.0
    store_bytes: int = 0
    store_seconds: float = 0.0
    load_sizes: Sequence[int] = ()
    store_sizes: Sequence[int] = ()


@dataclass(slots=True, frozen=True)
class Registration:
    session_id: str
    namespace_id: str
    epoch: int
    slot_bytes: int
    tenant: str


@dataclass(slots=True)
class StoreAnswer:
    cannot_store: bool
    keys_to_store: list[bytes]
    slot_offsets: list[int]
    evicted_keys: list[bytes]


@dataclass(slots=True, frozen=True)
class CompleteStoreResult:
    ignored: bool
    completed: int
    mismatched: int


@dataclass(slots=True, frozen=True)
class SessionView:
    session_id: str
    engine: EngineInfo
    namespace_id: str
    model: str
    tenant: str
    peer_uid: int
    peer_gid: int
    peer_pid: int
    pins: int
    pending_stores: int
    leases: int
    age_seconds: float
    idle_seconds: float


@dataclass(slots=True)
class Namespace:
    id: str
    model: str
    layout: Layout
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


@dataclass(slots=True, eq=False)
class Session:
    id: str
    token: str
    peer: PeerCred
    tenant: str
    created: float
    last_seen: float
    engine: EngineInfo = field(default_factory=EngineInfo)
    ns: Namespace | None = None
    pins: dict[tuple[int, bytes], int] = field(default_factory=dict)
    leases: dict[bytes, tuple[float, int]] = field(default_factory=dict)   # key -> (expiry, epoch)
    pending: dict[tuple[int, bytes], int] = field(default_factory=dict)    # (epoch, key) -> slot
    requests: set[str] = field(default_factory=set)
    closed: bool = False

    @property
    def epoch(self) -> int:
        return self.ns.epoch if self.ns is not None else 0

    @property
    def session_id(self) -> str:
        return self.id

    def pin_count(self) -> int:
        return sum(self.pins.values())


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


@dataclass(slots=True)
class Quarantined:
    ns: Namespace
    slots: list[int]
    pid: int
    since: float


class KvdCore:
    """Everything the daemon knows, minus the bytes (those live in the pool)."""

    def __init__(self, config: Any, extents: ExtentAllocator, *,
                 clock: Callable[[], float] = time.monotonic,
                 alive: Callable[[int], bool] = pid_alive) -> None:
        self.config = config
        self.alive = alive
        self._quarantine: list[Quarantined] = []
        self.extents = extents
        self.clock = clock
        self.state = DaemonState.STARTING
        self.instance_id = secrets.token_hex(8)
        self.started = clock()
        self._sessions: dict[str, Session] = {}         # token -> session
        self._namespaces: dict[str, Namespace] = {}
        self._budgets: dict[str, TenantBudget] = {}     # tenant -> its extent quota
        self._lease_heap: list[tuple[float, int, str, bytes]] = []
        self._lease_seq = 0
        self._session_seq = 0
        self.attached_total = 0
        self.reaped_total = 0
        self.closed_total = 0
        self.leases_expired_total = 0
        self.resets_total = 0
        self.transfers = TransferStats()
        # Bytes of blocks whose copies completed, counted by the daemon itself (block size x
        # completions), so bandwidth is visible whatever the client reports.
        self.completed_load_bytes = 0
        self.completed_store_bytes = 0

    # ------------------------------------------------------------ lifecycle
    def set_serving(self) -> None:
        if self.state is DaemonState.STARTING:
            self.state = DaemonState.SERVING

    def start_drain(self) -> bool:
        if self.state is DaemonState.DRAINING:
            return False
        self.state = DaemonState.DRAINING
        return True

    def loads_in_flight(self) -> int:
        return sum(s.pin_count() + len(s.leases) for s in self._sessions.values())

    # ------------------------------------------------------------- sessions
    def tenant_of(self, peer: PeerCred) -> str:
        tenants = self.config.tenants
        return tenants.uids.get(str(peer.uid)) or tenants.gids.get(str(peer.gid)) \
            or DEFAULT_TENANT

    def check_peer(self, peer: PeerCred) -> None:
        srv = self.config.server
        if srv.allowed_uids or srv.allowed_gids:
            if peer.uid in srv.allowed_uids or peer.gid in srv.allowed_gids or peer.uid == 0:
                return
            raise PermissionDenied(f"uid {peer.uid} / gid {peer.gid} may not attach "
                                   "(server.allowed_uids / server.allowed_gids)")

    def is_admin(self, peer: PeerCred) -> bool:
        srv = self.config.server
        if peer.uid in (0, os.getuid()):
            return True
        return peer.uid in srv.admin_uids or peer.gid in srv.admin_gids

    def attach(self, peer: PeerCred, role: str = "engine") -> Session | None:
        """Verify a peer; for an engine, open a session (None for a data-plane attach)."""
        self.check_peer(peer)
        if self.state is DaemonState.DRAINING:
            raise Unavailable("daemon is draining; attach to it again after its restart")
        if role != "engine":
            return None
        if len(self._sessions) >= self.config.server.max_sessions:
            raise ResourceExhausted(f"{len(self._sessions)} sessions already "
                                    "(server.max_sessions)")
        now = self.clock()
        self._session_seq += 1
        session = Session(id=f"s{self._session_seq}-{secrets.token_hex(3)}",
                          token=secrets.token_hex(32), peer=peer, tenant=self.tenant_of(peer),
                          created=now, last_seen=now)
        self._sessions[session.token] = session
        self.attached_total += 1
        log.info("session %s attached: pid %d uid %d tenant %s", session.id, peer.pid,
                 peer.uid, session.tenant)
        return session

    def authenticate(self, token: str) -> Session:
        session = self._sessions.get(token)
        if session is None:
            raise Unauthenticated("unknown or expired session token; attach again")
        session.last_seen = self.clock()
        return session

    def heartbeat(self, s: Session) -> None:
        s.last_seen = self.clock()

    def register(self, s: Session, engine: EngineInfo, model: str, layout: Layout,
                 salt: str) -> Registration:
        if not model:
            raise InvalidArgument("model must not be empty")
        if layout.block_bytes != layout.num_ranks * layout.shard_bytes:
            raise InvalidArgument(f"layout.block_bytes ({layout.block_bytes}) must equal "
                                  f"num_ranks ({layout.num_ranks}) x shard_bytes "
                                  f"({layout.shard_bytes})")
        ns_id = namespace_id(model, layout, salt, s.tenant)
        if s.ns is not None:
            if s.ns.id != ns_id:
                raise FailedPrecondition(f"session {s.id} is already registered in namespace "
                                         f"{s.ns.id}; open another session for another layout")
        else:
            ns = self._namespaces.get(ns_id)
            if ns is None:
                ns = self._new_namespace(ns_id, model, layout, salt, s.tenant)
            ns.sessions += 1
            s.ns = ns
            s.engine = engine
            log.info("session %s registered: engine %s %s (%s), namespace %s (%s, %d bytes "
                     "per block)", s.id, engine.engine_kind or "?", engine.engine_id or "?",
                     engine.engine_version or "?", ns_id, model, layout.block_bytes)
        assert s.ns is not None
        return Registration(s.id, s.ns.id, s.ns.epoch, s.ns.slots.stride, s.tenant)

    def _new_namespace(self, ns_id: str, model: str, layout: Layout, salt: str,
                       tenant: str) -> Namespace:
        if len(self._namespaces) >= MAX_NAMESPACES:
            self._gc_namespaces()
            if len(self._namespaces) >= MAX_NAMESPACES:
                raise ResourceExhausted(f"{MAX_NAMESPACES} namespaces exist already")
        try:
            slots = NamespaceSlots(self.extents, layout.block_bytes,
                                   budget=self._budget(tenant))
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        mgr = NamespaceManager(slots, self.config.manager.policy)
        ns = Namespace(ns_id, model, layout, salt, tenant, slots, mgr)
        self._namespaces[ns_id] = ns
        return ns

    def _budget(self, tenant: str) -> TenantBudget:
        budget = self._budgets.get(tenant)
        if budget is None:
            quota = self.config.tenants.quota_of(tenant)
            budget = TenantBudget(tenant, max(1, quota // self.extents.extent_bytes)
                                  if quota else None)
            self._budgets[tenant] = budget
        return budget

    def _gc_namespaces(self) -> None:
        for ns_id in [i for i, ns in self._namespaces.items()
                      if ns.sessions == 0 and ns.mgr.is_empty() and not ns.slots.in_use]:
            self._namespaces[ns_id].slots.release_extents()
            del self._namespaces[ns_id]

    def close_session(self, s: Session, reason: str, *, reaped: bool = False) -> None:
        """End a session: release its leases and pins, fail its pending stores. Idempotent."""
        if s.closed:
            return
        s.closed = True
        self._sessions.pop(s.token, None)
        if reaped:
            self.reaped_total += 1
        else:
            self.closed_total += 1
        ns = s.ns
        released = failed = 0
        leases = len(s.leases)
        if ns is not None:
            mgr = ns.mgr
            for key, (_, epoch) in s.leases.items():
                mgr.unpin(key, epoch)
            for (epoch, key), count in s.pins.items():
                for _ in range(count):
                    mgr.complete_load((key,), None, epoch)
                released += count
            held: list[int] = []
            for epoch, key in s.pending:
                mgr.complete_store((key,), False, None, epoch, hold=held)
                failed += 1
            if held:
                self._quarantine.append(Quarantined(ns, held, s.peer.pid, self.clock()))
            for req_id in s.requests:
                mgr.forget_request((s.id, req_id))
            ns.sessions -= 1
            self._maybe_release(ns)
        s.leases.clear()
        s.pins.clear()
        s.pending.clear()
        log.info("session %s ended (%s): released %d pins, %d leases, failed %d pending "
                 "stores", s.id, reason, released, leases, failed)

    def forgive(self, seconds: float) -> None:
        """Credit every session with `seconds` of heartbeat: the daemon was not listening."""
        if seconds >= 1.0:
            log.warning("the daemon did not run for %.1fs (stopped or starved); liveness "
                        "deadlines moved by that much", seconds)
        for s in self._sessions.values():
            s.last_seen += seconds

    def sweep(self) -> None:
        """Expire leases, end silent sessions, release quarantined slots whose writer is gone."""
        now = self.clock()
        if self._quarantine:
            self._release_quarantine(now)
        heap = self._lease_heap
        while heap and heap[0][0] <= now:
            expiry, _, token, key = heapq.heappop(heap)
            s = self._sessions.get(token)
            if s is None:
                continue
            lease = s.leases.get(key)
            if lease is None or lease[0] != expiry:
                continue  # renewed or already used by a load
            del s.leases[key]
            if s.ns is not None:
                s.ns.mgr.unpin(key, lease[1])
                self._maybe_release(s.ns)
            self.leases_expired_total += 1
        timeout = self.config.manager.liveness_timeout
        for s in [s for s in self._sessions.values() if now - s.last_seen > timeout]:
            self.close_session(s, f"no heartbeat for {now - s.last_seen:.1f}s", reaped=True)

    def _release_quarantine(self, now: float) -> None:
        grace = self.config.manager.liveness_timeout
        keep: list[Quarantined] = []
        for q in self._quarantine:
            if now - q.since >= QUARANTINE_MAX_S or (now - q.since >= grace
                                                      and not self.alive(q.pid)):
                for slot in q.slots:
                    q.ns.slots.free(slot)
                self._maybe_release(q.ns)
            else:
                keep.append(q)
        self._quarantine = keep

    def quarantined_slots(self) -> int:
        return sum(len(q.slots) for q in self._quarantine)

    # ------------------------------------------------------------ operations
    def _ns(self, s: Session) -> Namespace:
        if s.ns is None:
            raise FailedPrecondition("session is not registered; call RegisterSession first")
        return s.ns

    def _req(self, s: Session, req_id: str) -> tuple[str, str] | None:
        """The manager's request key; None (no request scope) for an empty req_id."""
        if not req_id:
            return None
        if req_id not in s.requests:
            if len(s.requests) >= MAX_OPEN_REQUESTS_PER_SESSION:
                return None  # too many unfinished requests: record no more recency for it
            s.requests.add(req_id)
        return (s.id, req_id)

    def _check_epoch(self, ns: Namespace, epoch: int) -> None:
        if epoch > ns.epoch:
            raise FailedPrecondition(f"epoch {epoch} is ahead of the namespace's epoch "
                                     f"{ns.epoch}")

    def _maybe_release(self, ns: Namespace) -> None:
        if ns.slots.extents_held() and ns.mgr.is_empty():
            ns.slots.release_extents()

    def lookup(self, s: Session, keys: Sequence[bytes], *, prefix: bool = False,
               lease_ms: int = 0, req_id: str = ""
               ) -> tuple[list[Lookup], int, list[int] | None]:
        ns = self._ns(s)
        mgr = ns.mgr
        epoch = mgr.epoch
        lease_s = min(lease_ms / 1000.0, self.config.manager.max_lease) if lease_ms else 0.0
        expiry = self.clock() + lease_s
        states: list[Lookup] = []
        offsets: list[int] | None = [] if lease_s > 0 else None
        hits = 0
        for key in keys:
            state = mgr.lookup(key)
            states.append(state)
            offset = 0
            if state is Lookup.HIT:
                hits += 1
                if offsets is not None:
                    self._lease(s, ns, key, expiry, epoch)
                    offset = ns.slots.offset(mgr.slot_of(key))  # type: ignore[arg-type]
            if offsets is not None:
                offsets.append(offset)
            if prefix and state is not Lookup.HIT:
                break
        ns.lookups_total += len(states)
        ns.hits_total += hits
        ns.misses_total += sum(1 for st in states if st is Lookup.MISS)
        return states, epoch, offsets

    def _lease(self, s: Session, ns: Namespace, key: bytes, expiry: float, epoch: int) -> None:
        current = s.leases.get(key)
        if current is not None and current[1] == epoch:
            s.leases[key] = (max(expiry, current[0]), epoch)
        else:
            if len(s.leases) >= MAX_LEASES_PER_SESSION:
                raise ResourceExhausted(f"session holds {len(s.leases)} leases already; load "
                                        "or let them expire")
            if current is not None:  # a lease from an older epoch: release its zombie ref
                ns.mgr.unpin(key, current[1])
            if not ns.mgr.pin(key):
                return
            s.leases[key] = (expiry, epoch)
        self._lease_seq += 1
        heapq.heappush(self._lease_heap, (s.leases[key][0], self._lease_seq, s.token, key))

    def prepare_load(self, s: Session, keys: Sequence[bytes], req_id: str,
                     positions: Sequence[int] | None) -> tuple[list[int], int]:
        ns = self._ns(s)
        mgr = ns.mgr
        epoch = mgr.epoch
        leased = []
        for i, key in enumerate(keys):
            lease = s.leases.get(key)
            if lease is not None and lease[1] == epoch:
                leased.append(key)
            elif mgr.lookup(key) is not Lookup.HIT:
                raise FailedPrecondition(f"key #{i} ({key[:16].hex()}) is not a readable block "
                                         "(absent, evicted or still being stored); look it up "
                                         "again")
        slots = mgr.prepare_load(keys, self._req(s, req_id), positions or None)
        for key in leased:  # the pin just taken replaces the lease's ref
            del s.leases[key]
            mgr.unpin(key, epoch)
        pins = s.pins
        for key in keys:
            pins[(epoch, key)] = pins.get((epoch, key), 0) + 1
        offset = ns.slots.offset
        return [offset(slot) for slot in slots], epoch

    def complete_load(self, s: Session, keys: Sequence[bytes], req_id: str, epoch: int) -> bool:
        ns = self._ns(s)
        self._check_epoch(ns, epoch)
        mgr = ns.mgr
        for key in keys:
            pk = (epoch, key)
            count = s.pins.get(pk)
            if not count:
                lease = s.leases.get(key)
                if lease is not None and lease[1] == epoch:
                    # Leased by this session and not loaded: the engine gives the lease back.
                    del s.leases[key]
                    mgr.unpin(key, epoch)
                continue  # never touch another session's pin or lease
            if count == 1:
                del s.pins[pk]
            else:
                s.pins[pk] = count - 1
            mgr.complete_load((key,), None, epoch)
            self.completed_load_bytes += ns.layout.block_bytes
        stale = epoch < ns.epoch
        if stale:
            self._maybe_release(ns)
        return stale

    def touch(self, s: Session, keys: Sequence[bytes], req_id: str) -> None:
        ns = self._ns(s)
        ns.mgr.touch(keys, self._req(s, req_id))

    def prepare_store(self, s: Session, keys: Sequence[bytes], req_id: str,
                      positions: Sequence[int] | None) -> tuple[StoreAnswer, int]:
        ns = self._ns(s)
        if self.state is DaemonState.DRAINING:
            raise Unavailable("daemon is draining; stores are refused")
        mgr = ns.mgr
        epoch = mgr.epoch
        grant = mgr.prepare_store(keys, self._req(s, req_id), positions or None)
        if grant is None:
            return StoreAnswer(True, [], [], []), epoch
        offset = ns.slots.offset
        pending = s.pending
        for key, slot in zip(grant.keys_to_store, grant.slots, strict=True):
            pending[(epoch, key)] = slot
        return StoreAnswer(False, grant.keys_to_store, [offset(x) for x in grant.slots],
                           grant.evicted_keys), epoch

    def complete_store(self, s: Session, keys: Sequence[bytes], success: bool, req_id: str,
                       epoch: int, offsets: Sequence[int] | None = None) -> CompleteStoreResult:
        ns = self._ns(s)
        self._check_epoch(ns, epoch)
        own: list[bytes] = []
        mismatched = 0
        for i, key in enumerate(keys):
            pk = (epoch, key)
            slot = s.pending.get(pk)
            if slot is None:
                continue  # not this session's store (or already completed): ignored
            if offsets is not None and ns.slots.offset(slot) != offsets[i]:
                mismatched += 1
                continue
            del s.pending[pk]
            own.append(key)
        if epoch < ns.epoch:
            ns.mgr.complete_store(own, success, None, epoch)
            self._maybe_release(ns)
            return CompleteStoreResult(True, 0, mismatched)
        completed = ns.mgr.complete_store(own, success, None, epoch)
        self.completed_store_bytes += completed * ns.layout.block_bytes
        if not success:
            self._maybe_release(ns)
        return CompleteStoreResult(False, completed, mismatched)

    def request_finished(self, s: Session, req_id: str) -> None:
        ns = self._ns(s)
        ns.mgr.request_finished((s.id, req_id))
        s.requests.discard(req_id)

    def take_events(self, s: Session, max_events: int) -> tuple[list[OffloadEvent], bool]:
        # Events belong to the namespace: with several engines in one namespace, whichever
        # asks drains them (vLLM's KV-event consumers dedupe by block hash).
        return self._ns(s).mgr.take_events(max_events)

    def reset_namespace(self, s: Session) -> tuple[int, int]:
        ns = self._ns(s)
        dropped = self._reset(ns)
        return ns.epoch, dropped

    def _reset(self, ns: Namespace) -> int:
        old = ns.epoch
        dropped = ns.mgr.reset()
        # Leases die with the epoch: release their zombie refs now.
        for s in self._sessions.values():
            if s.ns is ns and s.leases:
                for key, (_, epoch) in list(s.leases.items()):
                    ns.mgr.unpin(key, epoch)
                s.leases.clear()
        self._maybe_release(ns)
        self.resets_total += 1
        log.info("namespace %s reset: %d blocks dropped, epoch %d -> %d", ns.id, dropped, old,
                 ns.epoch)
        return dropped

    def admin_reset(self, namespace_id: str | None) -> tuple[int, int]:
        if namespace_id:
            ns = self._namespaces.get(namespace_id)
            if ns is None:
                raise NotFound(f"no namespace {namespace_id!r} (see `kvd stats`)")
            targets = [ns]
        else:
            targets = list(self._namespaces.values())
        dropped = sum(self._reset(ns) for ns in targets)
        return dropped, len(targets)

    def transfer_report(self, s: Session, report: TransferStats) -> None:
        t = self.transfers
        t.load_bytes += report.load_bytes
        t.load_seconds += max(0.0, report.load_seconds)
        t.store_bytes += report.store_bytes
        t.store_seconds += max(0.0, report.store_seconds)

    # ------------------------------------------------------------- reporting
    def sessions(self, limit: int) -> tuple[list[SessionView], int]:
        now = self.clock()
        views = []
        for s in list(self._sessions.values())[:limit]:
            views.append(SessionView(
                session_id=s.id, engine=s.engine, namespace_id=s.ns.id if s.ns else "",
                model=s.ns.model if s.ns else "", tenant=s.tenant, peer_uid=s.peer.uid,
                peer_gid=s.peer.gid, peer_pid=s.peer.pid, pins=s.pin_count(),
                pending_stores=len(s.pending), leases=len(s.leases),
                age_seconds=now - s.created, idle_seconds=now - s.last_seen))
        return views, len(self._sessions)

    def stats(self) -> dict[str, Any]:
        ext = self.extents
        totals = {"storing": 0, "ready": 0, "pinned": 0, "zombie": 0}
        counters = dict.fromkeys(("lookups_total", "hits_total", "misses_total",
                                  "stores_started_total", "stores_completed_total",
                                  "stores_failed_total", "evictions_total",
                                  "store_rejections_total"), 0)
        namespaces = []
        for ns in self._namespaces.values():
            c = ns.mgr.counts()
            blocks = {"storing": c.storing, "ready": c.ready, "pinned": c.pinned,
                      "zombie": c.zombie}
            for k, v in blocks.items():
                totals[k] += v
            mc = ns.mgr.counters
            row = {
                "id": ns.id, "model": ns.model, "tenant": ns.tenant,
                "slot_bytes": ns.slots.stride, "block_bytes": ns.layout.block_bytes,
                "num_ranks": ns.layout.num_ranks, "slots_capacity": ns.slots.capacity(),
                "extents": ns.slots.extents_held(), "epoch": ns.epoch, "sessions": ns.sessions,
                "blocks": blocks,
                "lookups_total": ns.lookups_total, "hits_total": ns.hits_total,
                "misses_total": ns.misses_total,
                "stores_started_total": mc.stores_started_total,
                "stores_completed_total": mc.stores_completed_total,
                "stores_failed_total": mc.stores_failed_total,
                "evictions_total": mc.evictions_total,
                "store_rejections_total": mc.store_rejections_total,
            }
            for key in counters:
                counters[key] += row[key]
            namespaces.append(row)
        pins = sum(s.pin_count() for s in self._sessions.values())
        leases = sum(len(s.leases) for s in self._sessions.values())
        t = self.transfers
        return {
            "server": {"version": __version__, "pid": os.getpid(),
                       "uptime_seconds": self.clock() - self.started,
                       "state": self.state.value, "policy": self.config.manager.policy,
                       "instance_id": self.instance_id},
            "pool": {"total_bytes": ext.pool_bytes, "used_bytes": ext.used_bytes,
                     "free_bytes": ext.free_bytes, "extent_bytes": ext.extent_bytes,
                     "extents_total": ext.total, "extents_free": ext.free_extents(),
                     "quarantined_slots": self.quarantined_slots()},
            "blocks": {**totals, "total": totals["storing"] + totals["ready"]
                       + totals["pinned"]},
            "sessions": len(self._sessions),
            "clients": {"active": len(self._sessions), "attached_total": self.attached_total,
                        "reaped_total": self.reaped_total, "closed_total": self.closed_total},
            "namespaces": namespaces,
            "tenants": {b.tenant: {"used_bytes": b.held * ext.extent_bytes,
                                   "quota_bytes": (b.max_extents or 0) * ext.extent_bytes}
                        for b in self._budgets.values()},
            "stats": {**counters, "pins": pins, "leases": leases,
                      "leases_expired_total": self.leases_expired_total,
                      "resets_total": self.resets_total},
            "transfers": {"completed_load_bytes_total": self.completed_load_bytes,
                          "completed_store_bytes_total": self.completed_store_bytes,
                          "load_bytes_total": t.load_bytes, "load_seconds_total": t.load_seconds,
                          "store_bytes_total": t.store_bytes,
                          "store_seconds_total": t.store_seconds},
        }


def namespace_id(model: str, layout: Layout, salt: str, tenant: str) -> str:
    """Digest of everything that must match for two engines to share blocks."""
    h = hashlib.sha256()
    for part in (model, str(layout.block_bytes), str(layout.num_ranks), str(layout.shard_bytes),
                 str(layout.tokens_per_block), layout.dtype, salt, tenant):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]
