"""The daemon's core: engine sessions over their namespaces, and what ties them together.

Pure logic on the event-loop thread (clock injected, no I/O). `SessionTable` knows who is
attached, `NamespaceTable` which namespaces exist, and each namespace's `NamespaceManager`
keeps its block index. The core adds what ties them together: sessions' lives (attach,
register, end, the liveness sweep), leases, epochs and resets, events and drain. The engine
protocols' operations are not its own: they stand above it (kvd_server/protocols/), built over
it by the daemon's wiring, and so does the tier below the pool (kvd_server/tiers/): the core
imports neither.
Ownership is strict: a session only ever releases its own pins and leases and completes its
own stores, so a buggy or hostile client cannot disturb another engine's state.
"""

from __future__ import annotations

import enum
import logging
import secrets
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvd_proto.wire import MAX_EVENT_ANSWER_BYTES, KvLayout
from kvd_server.config import Config
from kvd_server.core.leases import Leases
from kvd_server.core.namespaces import (
    Held,
    Namespace,
    NamespaceTable,
    SlotQuarantine,
    namespace_id,
    pid_alive,
)
from kvd_server.core.peer import PeerCred
from kvd_server.core.retention import Retention
from kvd_server.core.sessions import (
    MAX_OPEN_REQUESTS_PER_SESSION,
    MAX_PINS_PER_SESSION,
    EngineInfo,
    Session,
    SessionTable,
    SessionView,
)
from kvd_server.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from kvd_server.manager import NamespaceManager, OffloadEvent
from kvd_server.memory.extents import ExtentAllocator

log = logging.getLogger(__name__)


class SessionRecords(Protocol):
    """The warm restart's side of sessions (kvd_server/restart/warm.py)."""

    def registered(self, s: Session, ns: Namespace) -> None: ...

    def ended(self, s: Session, held: bool) -> None: ...

    def sweep(self, core: KvdCore) -> None: ...


class DaemonState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"


# --- answers ---------------------------------------------------------------------------------


class Registration(NamedTuple):
    session_id: str
    namespace_id: str
    epoch: int
    slot_bytes: int
    tenant: str


class EventBatch(NamedTuple):
    events: list[OffloadEvent]
    more: bool
    dropped: int = 0        # events dropped unseen since the namespace's previous answer


class ResetAnswer(NamedTuple):
    epoch: int
    dropped: int


class AdminResetAnswer(NamedTuple):
    dropped: int
    namespaces: int
    below: int = 0          # blocks the tiers below the pool (disk, cluster) dropped too


class SessionList(NamedTuple):
    sessions: list[SessionView]
    total: int


@dataclass(slots=True)
class TransferStats:
    load_bytes: int = 0
    load_seconds: float = 0.0
    store_bytes: int = 0
    store_seconds: float = 0.0


class KvdCore:
    """Everything the daemon knows, minus the bytes (those live in the pool)."""

    def __init__(self, config: Config, extents: ExtentAllocator, *,
                 clock: Callable[[], float] = time.monotonic,
                 alive: Callable[[int], bool] = pid_alive) -> None:
        self.config = config
        self.extents = extents
        self.clock = clock
        self.state = DaemonState.STARTING
        self.instance_id = secrets.token_hex(8)
        self.started = clock()
        self.sessions = SessionTable(config, clock)
        self.namespaces = NamespaceTable(extents, config.manager.policy, config.tenants)
        self.quarantine = SlotQuarantine(alive)
        self.leases = Leases()
        # Agent sessions' retention hints, their quotas and expiry (core/retention.py).
        self.retention = Retention(self.namespaces, config, clock)
        self.resets_total = 0
        self.transfers = TransferStats()
        # Bytes of blocks whose copies completed, counted by the daemon itself (block size x
        # completions), so bandwidth is visible whatever the client reports.
        self.completed_load_bytes = 0
        self.completed_store_bytes = 0
        # Per namespace manager: the events_dropped_total its last TakeEvents answer covered
        # (weak: an entry goes with its namespace).
        self._events_reported: weakref.WeakKeyDictionary[NamespaceManager, int] = \
            weakref.WeakKeyDictionary()
        # Called first when a session ends (while it is still live): its channel is read
        # one last time and closed.
        self.on_session_end: list[Callable[[Session], None]] = []
        # Warm restart (kvd_server/restart/warm.py): told of sessions as they register and
        # end, swept with the rest; None when restart.warm is off.
        self.warm: SessionRecords | None = None

    # ------------------------------------------------------------ lifecycle
    def set_serving(self) -> None:
        if self.state is DaemonState.STARTING:
            self.state = DaemonState.SERVING

    def start_drain(self) -> bool:
        if self.state is DaemonState.DRAINING:
            return False
        self.state = DaemonState.DRAINING
        return True

    @property
    def draining(self) -> bool:
        return self.state is DaemonState.DRAINING

    def loads_in_flight(self) -> int:
        return sum(s.pin_count() + len(s.leases) for s in self.sessions)

    # ------------------------------------------------------------- sessions
    def attach(self, peer: PeerCred, role: str = "engine") -> Session | None:
        """Verify a peer; for an engine, open a session (None for a data-plane attach)."""
        self.sessions.check_peer(peer)
        if self.state is DaemonState.DRAINING:
            raise Unavailable("daemon is draining; attach to it again after its restart")
        if role != "engine":
            return None
        return self.sessions.open(peer)

    def authenticate(self, token: str) -> Session:
        return self.sessions.authenticate(token)

    def heartbeat(self, s: Session) -> None:
        self.sessions.heartbeat(s)

    def register(self, s: Session, engine: EngineInfo, model: str, layout: KvLayout,
                 salt: str) -> Registration:
        if not model:
            raise InvalidArgument("model must not be empty")
        ns_id = namespace_id(model, layout, salt, s.tenant)
        if s.ns is not None:
            if s.ns.id != ns_id:
                raise FailedPrecondition(f"session {s.id} is already registered in namespace "
                                         f"{s.ns.id}; open another session for another layout")
        else:
            ns = self.namespaces.join(model, layout, salt, s.tenant)
            if self.warm is not None:
                try:
                    self.warm.registered(s, ns)
                except OSError as exc:
                    self.namespaces.leave(ns)
                    raise ResourceExhausted(
                        f"cannot record the session for warm restart ({exc.strerror or exc}):"
                        " a session off the record could write into slots a restarted daemon"
                        " hands out again; free space in restart.directory (restart.store ="
                        ' "systemd": raise the unit\'s FileDescriptorStoreMax=), or set '
                        "restart.warm = false"
                    ) from None
            s.ns = ns
            s.engine = engine
            log.info("session %s registered: engine %s %s (%s), namespace %s (%s, %d bytes "
                     "per block)", s.id, engine.engine_kind or "?", engine.engine_id or "?",
                     engine.engine_version or "?", ns_id, model, layout.block_bytes)
        return Registration(s.id, s.ns.id, s.ns.epoch, s.ns.slots.stride, s.tenant)

    def close_session(self, s: Session, reason: str, *, reaped: bool = False,
                      copies_done: bool = False) -> None:
        """End a session. Idempotent.

        With `copies_done` (the client closed its session itself: CloseSession), or when its
        process is gone, its pins and leases are released and its unfinished stores freed at
        once. Otherwise (the stream closed, the session was reaped) its process may still be
        copying: they are held in the quarantine until it is gone or a later session of the
        same process releases them (ReleaseHeld).
        """
        if s.closed:
            return
        for hook in self.on_session_end:
            try:
                hook(s)
            except Exception:  # the session must end whatever its channel does
                log.exception("ending session %s: hook failed", s.id)
        if not self.sessions.remove(s, reaped=reaped):
            return
        ns = s.ns
        refs = [(epoch, key) for (epoch, key), n in s.pins.items() for _ in range(n)]
        refs += [(epoch, key) for key, (_, epoch) in s.leases.items()]
        held = Held(ns, s.id, s.peer.pid, self.clock(), [], refs, s.reader) \
            if ns is not None else None
        if ns is not None and held is not None:
            mgr = ns.mgr
            for (epoch, key), slot in s.pending.items():
                mgr.complete_store((key,), False, None, epoch, hold=held.slots, slots=(slot,))
            held.slots.extend(ns.end_reserve(s))   # it may be writing into them
            for req_id in s.requests:
                mgr.forget_request((s.id, req_id))
            lives = not copies_done and self.quarantine.alive(s.peer.pid)
            if ns.reclaim is not None and s.reader:
                ns.reclaim.end_reader(s.id, process_lives=lives)
            if self.warm is not None:
                self.warm.ended(s, held=lives)
            if lives:
                self.quarantine.hold(held)
                what = "holds (its process lives on)"
            else:
                SlotQuarantine.release(held)
                what = "released"
            self.namespaces.leave(ns)
            log.info("session %s ended (%s): %s %d pins and leases and %d unfinished stores",
                     s.id, reason, what, len(held.refs), len(held.slots))
        else:
            log.info("session %s ended (%s) before registering", s.id, reason)
        self.leases.drop(s)
        s.pins.clear()
        s.pending.clear()

    def release_held(self, s: Session, session_id: str) -> tuple[int, int]:
        """A session says an earlier session of its own process has no copies in flight any
        more: release what the daemon held for it; (pins, slots) released. Idempotent: (0, 0)
        when nothing is held for that session of this process (released already, or never)."""
        released = self.quarantine.release_session(session_id, s.peer.pid)
        if released is None:
            return 0, 0
        log.info("session %s released what its predecessor %s held: %d pins, %d slots",
                 s.id, session_id, *released)
        return released

    @property
    def leases_expired_total(self) -> int:
        return self.leases.expired_total

    def forgive(self, seconds: float) -> None:
        """Credit every session with `seconds` of heartbeat: the daemon was not listening."""
        self.sessions.forgive(seconds)

    def sweep(self) -> None:
        """Expire leases, end silent sessions, release quarantined slots whose writer is gone."""
        now = self.clock()
        if self.quarantine:
            self.quarantine.release_due()
        if self.warm is not None:
            self.warm.sweep(self)
        self.leases.expire(now, self.sessions.get)
        self.retention.sweep()
        for s, why in self.sessions.expired():
            self.close_session(s, why, reaped=True)
        self.namespaces.collect_idle()      # idle empty namespaces give their index back
        for ns in self.namespaces:
            ns.slots.collect()              # slots every reader has moved past come back

    # ------------------------------------------- operations shared by both protocols
    @staticmethod
    def namespace_of(s: Session) -> Namespace:
        if s.ns is None:
            raise FailedPrecondition("session is not registered; call RegisterSession first")
        return s.ns

    @staticmethod
    def request_key(s: Session, req_id: str) -> tuple[str, str] | None:
        """The manager's request key; None (no request scope) for an empty req_id."""
        if not req_id:
            return None
        if req_id not in s.requests:
            if len(s.requests) >= MAX_OPEN_REQUESTS_PER_SESSION:
                return None  # too many unfinished requests: record no more recency for it
            s.requests.add(req_id)
        return (s.id, req_id)

    @staticmethod
    def check_pin_room(s: Session, more: int) -> None:
        if len(s.pins) + more > MAX_PINS_PER_SESSION:
            raise ResourceExhausted(f"session holds {len(s.pins)} pins already (at most "
                                    f"{MAX_PINS_PER_SESSION}); complete loads first")

    def touch(self, s: Session, keys: Sequence[bytes], req_id: str) -> None:
        ns = self.namespace_of(s)
        ns.mgr.touch(keys, self.request_key(s, req_id))

    def request_finished(self, s: Session, req_id: str) -> None:
        ns = self.namespace_of(s)
        ns.mgr.request_finished((s.id, req_id))
        s.requests.discard(req_id)

    def take_events(self, s: Session, max_events: int,
                    max_bytes: int = MAX_EVENT_ANSWER_BYTES) -> EventBatch:
        """Events belong to the namespace: with several engines in one namespace, whichever
        asks drains them (vLLM's KV-event consumers dedupe by block hash), and whichever asks
        first after some were dropped (nobody took them in time) is told how many, once."""
        mgr = self.namespace_of(s).mgr
        events, more = mgr.take_events(max_events, max_bytes)
        dropped_total = mgr.counters.events_dropped_total
        dropped = dropped_total - self._events_reported.get(mgr, 0)
        if dropped:
            self._events_reported[mgr] = dropped_total
        return EventBatch(events, more, dropped)

    def reset_namespace(self, s: Session) -> ResetAnswer:
        ns = self.namespace_of(s)
        dropped, _ = self._reset(ns)
        return ResetAnswer(ns.epoch, dropped)

    def _reset(self, ns: Namespace) -> tuple[int, int]:
        """Reset `ns`: the blocks dropped from the pool and from the tiers below it."""
        old = ns.epoch
        dropped, below = ns.mgr.reset_below()
        # Leases die with the epoch: release their zombie refs now.
        for s in self.sessions:
            if s.ns is ns:
                s.kept.clear()      # the blocks its granted slots held are gone with the epoch
                if s.leases:
                    self.leases.release(s, ns.mgr)
        ns.release_extents()
        self.resets_total += 1
        log.info("namespace %s reset: %d blocks dropped (%d below the pool), epoch %d -> %d",
                 ns.id, dropped, below, old, ns.epoch)
        return dropped, below

    def admin_reset(self, namespace_id: str | None) -> AdminResetAnswer:
        targets = [self.namespaces.get(namespace_id)] if namespace_id else list(self.namespaces)
        counts = [self._reset(ns) for ns in targets]
        return AdminResetAnswer(sum(c[0] for c in counts), len(targets),
                                sum(c[1] for c in counts))

    def transfer_report(self, report: TransferStats) -> None:
        """Add a data-plane worker's transfer totals (the attach role `report`)."""
        t = self.transfers
        t.load_bytes += report.load_bytes
        t.load_seconds += max(0.0, report.load_seconds)
        t.store_bytes += report.store_bytes
        t.store_seconds += max(0.0, report.store_seconds)

    def session_list(self, limit: int) -> SessionList:
        return SessionList(self.sessions.views(limit), len(self.sessions))
