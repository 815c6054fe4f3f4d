"""Engine sessions: who attached (the kernel's peer credentials), under which tenant and token,
what each session holds, and whether it is still alive.

A session is born at attach, bound to one namespace by RegisterSession and ended by its client,
its stream closing or the liveness sweep. What it holds (pins, leases, pending stores, open
requests) is released by the core when it ends. Pure logic: the clock is injected.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvd_server.config import DEFAULT_TENANT, Config
from kvd_server.core.namespaces import Namespace
from kvd_server.core.peer import PeerCred
from kvd_server.errors import PermissionDenied, ResourceExhausted, Unauthenticated

log = logging.getLogger(__name__)

# What one session may hold at once (and so what it can leave held if its process stalls).
MAX_LEASES_PER_SESSION = 16_384
MAX_PINS_PER_SESSION = 65_536          # (epoch, key) pins of loads in flight
MAX_PENDING_STORES_PER_SESSION = 16_384
MAX_OPEN_REQUESTS_PER_SESSION = 8_192  # requests whose accesses are recorded for recency


@dataclass(slots=True, frozen=True)
class EngineInfo:
    engine_id: str = ""
    engine_kind: str = ""
    engine_version: str = ""
    pid: int = 0
    hostname: str = ""


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
    pins: dict[tuple[int, bytes], int] = field(default_factory=dict)      # (epoch, key) -> n
    leases: dict[bytes, tuple[float, int]] = field(default_factory=dict)  # key -> (expiry, epoch)
    pending: dict[tuple[int, bytes], int] = field(default_factory=dict)   # (epoch, key) -> slot
    requests: set[str] = field(default_factory=set)
    granted: set[int] = field(default_factory=set)   # slots for stores it will decide itself
    reserve_target: int = 0                            # how many granted slots it wants
    # Granted slots that still hold the block evicted from them, as GRANTED named it to the
    # session (slot -> key; only a session that asked, RESERVE flag 2): it may take one back
    # as that block (RESTORE) until it stores into it or gives it back.
    kept: dict[int, bytes] = field(default_factory=dict)
    wants_kept: bool = False
    reader: bool = False                               # maps its namespace's shared index
    # Its requests' retention hints (kvd_server/core/retention.py): req_id -> Hint, bounded.
    hints: dict[str, Any] = field(default_factory=dict)
    closed: bool = False

    @property
    def epoch(self) -> int:
        return self.ns.epoch if self.ns is not None else 0

    def pin_count(self) -> int:
        return sum(self.pins.values())


@dataclass(slots=True, frozen=True)
class SessionView:
    """One row of `kvd sessions`."""

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


class SessionTable:
    """The live sessions by token, the attach rules (allowlist, tenants, limits) and liveness."""

    def __init__(self, config: Config, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self._by_token: dict[str, Session] = {}
        self._per_uid: dict[int, int] = {}
        self._seq = 0
        self.attached_total = 0
        self.reaped_total = 0
        self.closed_total = 0

    def __iter__(self) -> Iterator[Session]:
        return iter(self._by_token.values())

    def __len__(self) -> int:
        return len(self._by_token)

    # --------------------------------------------------------------- who may attach
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

    # ------------------------------------------------------------------- life cycle
    def open(self, peer: PeerCred) -> Session:
        """A new session for an engine peer the caller has checked."""
        srv = self.config.server
        if len(self._by_token) >= srv.max_sessions:
            raise ResourceExhausted(f"{len(self._by_token)} sessions already "
                                    "(server.max_sessions)")
        held = self._per_uid.get(peer.uid, 0)
        if held >= srv.max_sessions_per_uid:
            raise ResourceExhausted(f"uid {peer.uid} holds {held} sessions already "
                                    "(server.max_sessions_per_uid)")
        now = self.clock()
        self._seq += 1
        session = Session(id=f"s{self._seq}-{secrets.token_hex(3)}", token=secrets.token_hex(32),
                          peer=peer, tenant=self.tenant_of(peer), created=now, last_seen=now)
        self._by_token[session.token] = session
        self._per_uid[peer.uid] = held + 1
        self.attached_total += 1
        log.info("session %s attached: pid %d uid %d tenant %s", session.id, peer.pid,
                 peer.uid, session.tenant)
        return session

    def authenticate(self, token: str) -> Session:
        """The live session of `token` (its last_seen refreshed); Unauthenticated if none."""
        session = self._by_token.get(token)
        if session is None:
            raise Unauthenticated("unknown or expired session token; attach again")
        session.last_seen = self.clock()
        return session

    def get(self, token: str) -> Session | None:
        """The live session of `token`, without counting it as heard from."""
        return self._by_token.get(token)

    def heartbeat(self, s: Session) -> None:
        s.last_seen = self.clock()

    def remove(self, s: Session, *, reaped: bool) -> bool:
        """Forget a session; False when it was already closed."""
        if s.closed:
            return False
        s.closed = True
        self._by_token.pop(s.token, None)
        left = self._per_uid.pop(s.peer.uid, 1) - 1
        if left:
            self._per_uid[s.peer.uid] = left
        if reaped:
            self.reaped_total += 1
        else:
            self.closed_total += 1
        return True

    def expired(self) -> list[tuple[Session, str]]:
        """Sessions to end, with why: silent past manager.liveness_timeout, or unregistered
        past manager.register_timeout."""
        now = self.clock()
        m = self.config.manager
        out = []
        for s in self._by_token.values():
            if now - s.last_seen > m.liveness_timeout:
                out.append((s, f"no heartbeat for {now - s.last_seen:.1f}s"))
            elif s.ns is None and now - s.created > m.register_timeout:
                out.append((s, f"not registered {now - s.created:.1f}s after attaching"))
        return out

    def forgive(self, seconds: float) -> None:
        """Credit every session with `seconds` of heartbeat: the daemon was not listening."""
        if seconds >= 1.0:
            log.warning("the daemon did not run for %.1fs (stopped or starved); liveness "
                        "deadlines moved by that much", seconds)
        for s in self._by_token.values():
            s.last_seen += seconds

    def views(self, limit: int) -> list[SessionView]:
        now = self.clock()
        out = []
        for s in list(self._by_token.values())[:limit]:
            out.append(SessionView(
                session_id=s.id, engine=s.engine, namespace_id=s.ns.id if s.ns else "",
                model=s.ns.model if s.ns else "", tenant=s.tenant, peer_uid=s.peer.uid,
                peer_gid=s.peer.gid, peer_pid=s.peer.pid, pins=s.pin_count(),
                pending_stores=len(s.pending), leases=len(s.leases),
                age_seconds=now - s.created, idle_seconds=now - s.last_seen))
        return out
