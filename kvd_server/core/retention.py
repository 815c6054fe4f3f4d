"""Agent sessions' retention hints across the daemon: who may retain what, for how long.

A request's hint (HINT record, or the call protocol's `SetHint`) names an agent session and a
retention; the blocks the request then loads and stores are retained in their namespace
(kvd_server/manager/retention.py) until the hint expires or the session is released. Here:

- the hints of each engine session's requests (`Session.hints`, bounded: completions may
  arrive after a request finished, so a hint outlives its request until pushed out);
- the tenant's quota: what a tenant's retained blocks may occupy is `retention.max_share` of
  its pool share (its quota, else the whole pool); a hint past it is honoured in part (cut,
  counted), never refused;
- expiry (the core's sweep), release and the listing of sessions, each scoped to a tenant:
  a tenant sees and releases only its own (the admin API passes the caller's tenant, or None
  for an operator);
- the malformed hints refused: counted, and logged once per interval whatever their number.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvd_proto.ratelog import RateLimitedLog
from kvd_server.config import Config
from kvd_server.core.namespaces import Namespace, NamespaceTable
from kvd_server.core.sessions import Session
from kvd_server.errors import InvalidArgument
from kvd_server.manager.retention import RetentionCounters

log = logging.getLogger(__name__)

MAX_HINTS_PER_SESSION = 1024        # hints of one engine session's requests remembered
MAX_TAGS_LISTED = 10_000            # rows one listing returns at most
TENANT_TOKEN_TTL_S = 300.0
PREWARM_S = 10.0                    # a prewarm waits for free slots this long at most
MAX_PREWARM_JOBS = 1024             # prewarms (per namespace) waiting for slots at once
PREWARM_TICK_S = 0.002              # waiting prewarms try again at most this often
MAX_RELEASED = 1 << 16              # released sessions remembered (to void their old hints)


MAX_TENANT_TOKENS = 1024      # live tenant tokens; issuing one more forgets the oldest


class TenantTokens:
    """Tokens that scope the agent-session calls to one tenant (attach role `tenant`): issued
    to any allowed peer for its own tenant, short-lived, bounded."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 ttl: float = TENANT_TOKEN_TTL_S) -> None:
        self._clock = clock
        self.ttl = ttl
        self._issued: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def issue(self, tenant: str) -> str:
        now = self._clock()
        for token in [t for t, (_, expiry) in self._issued.items() if expiry <= now]:
            del self._issued[token]
        while len(self._issued) >= MAX_TENANT_TOKENS:
            self._issued.popitem(last=False)
        token = secrets.token_hex(16)
        self._issued[token] = (tenant, now + self.ttl)
        return token

    def tenant_of(self, token: str) -> str | None:
        """The tenant `token` was issued to, or None (unknown or expired)."""
        entry = self._issued.get(token)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            del self._issued[token]
            return None
        return entry[0]


@dataclass(slots=True, frozen=True)
class Hint:
    tag: str
    retain_s: float
    at: float               # when it was given (a release after it voids it)


@dataclass(slots=True, frozen=True)
class RetainedSession:
    """One agent session's blocks in one namespace (a row of `kvd session list`)."""

    tag: str
    tenant: str
    namespace_id: str
    model: str
    blocks: int              # retained in the pool
    bytes: int
    expires_in: float        # seconds until its last retained block's hint runs out
    tagged: int              # in the pool carrying its tag (retained or not)
    below: int               # remembered below the pool (a prewarm promotes them)


@dataclass(slots=True, frozen=True)
class PrewarmAnswer:
    promoting: int           # blocks being promoted into the pool now
    in_pool: int             # blocks the pool held already (retained again)
    namespaces: int          # namespaces it touched


@dataclass(slots=True, eq=False)
class PrewarmJob:
    """A prewarm's keys of one namespace that wait for free slots (see `Retention.prewarm`)."""

    ns: Namespace
    keys: list[bytes]
    tag: str
    until: float
    deadline: float
    started: set[bytes] = field(default_factory=set)


# Promote keys of a namespace from the tiers below (the tier link's `promote`): the keys
# being promoted. Set by the daemon's wiring when a tier is configured.
Promote = Callable[[Namespace, Sequence[bytes]], set[bytes]]


class Retention:
    """The daemon's side of retention hints (see the module doc)."""

    def __init__(self, namespaces: NamespaceTable, config: Config,
                 clock: Callable[[], float]) -> None:
        self.namespaces = namespaces
        self.config = config.retention
        self.pool_size = config.pool.size
        self.tenants = config.tenants
        self.clock = clock
        self.hints_total = 0
        self.refused = RateLimitedLog(log)
        # Per tenant, what its hints did (every namespace of it shares one: a namespace
        # collected takes none of the totals with it).
        self.counters: dict[str, RetentionCounters] = {}
        # Tokens that scope the agent-session admin calls to one tenant (attach role "tenant")
        self.tokens = TenantTokens(clock)
        self.promote: Promote | None = None          # set when a tier is below the pool
        self._jobs: list[PrewarmJob] = []            # prewarms waiting for free slots
        self._last_tick = 0.0
        # (tenant or None, tag) -> when it was released: hints given before it are void
        self._released: dict[tuple[str | None, str], float] = {}

    @property
    def hints_refused_total(self) -> int:
        return self.refused.total

    # ------------------------------------------------------------------ hints
    def hint(self, s: Session, req_id: str, tag: str, retain_ms: int) -> None:
        """Request `req_id` of session `s` hints: retain what it loads and stores `retain_ms`
        (0: retention.default_s), tagged `tag`. A malformed hint raises InvalidArgument
        (counted, logged at most once per interval); the request goes on without it."""
        cfg = self.config
        problem = ""
        if not req_id:
            problem = "no req_id"
        elif len(tag.encode()) > cfg.max_tag_bytes:
            problem = f"a session tag of {len(tag.encode())} bytes (at most " \
                      f"{cfg.max_tag_bytes}, retention.max_tag_bytes)"
        elif retain_ms > cfg.max_s * 1000:
            problem = f"retain_s {retain_ms / 1000:g} (at most {cfg.max_s:g}, retention.max_s)"
        elif not tag.isprintable():
            problem = "a session tag with control characters"
        if problem:
            self.refused.warning("hint of request %r of session %s (tenant %s) refused: %s",
                                 req_id[:64], s.id, s.tenant, problem)
            raise InvalidArgument(f"hint refused: {problem}")
        self.hints_total += 1
        if cfg.max_share <= 0:
            return
        hints = s.hints
        hints.pop(req_id, None)
        if len(hints) >= MAX_HINTS_PER_SESSION:
            del hints[next(iter(hints))]
        hints[req_id] = Hint(tag, retain_ms / 1000 if retain_ms else cfg.default_s,
                             self.clock())

    def touched(self, s: Session, req_id: str, keys: Sequence[bytes]) -> None:
        """Request `req_id` of `s` loaded or stored `keys` (readable now): retained if it
        hinted so, within its tenant's quota."""
        hint = s.hints.get(req_id)
        ns = s.ns
        if hint is None or ns is None or not keys:
            return
        if self._released and hint.tag:
            # Its session was released after the hint: a completion that arrives late (the
            # request's stores finish after its last step) retains nothing any more.
            released = max(self._released.get((ns.tenant, hint.tag), -1.0),
                           self._released.get((None, hint.tag), -1.0))
            if released >= hint.at:
                return
        self._count(ns)
        ns.mgr.retain(keys, hint.tag, self.clock() + hint.retain_s, self.room(ns))

    def _count(self, ns: Namespace) -> None:
        """`ns` counts into its tenant's counters (one object all its namespaces share)."""
        counters = self.counters.get(ns.tenant)
        if counters is None:
            counters = self.counters[ns.tenant] = RetentionCounters()
        ns.mgr.retention.counters = counters

    def prewarm(self, tag: str, tenant: str | None, keys: Sequence[bytes] = (),
                namespace_id: str = "", retain_s: float = 0.0) -> PrewarmAnswer:
        """Bring agent session `tag`'s blocks (or `keys`, tag or not) into the pool before
        its next turn: those below the pool promoted (HIT_PENDING until they land, then HIT),
        as many now as slots are free and the rest as slots come free (the sweep tries again,
        for PREWARM_S at most); those in it retained again; all retained `retain_s` (0:
        retention.default_s) within the tenant's quota. Only `tenant`'s namespaces (None:
        every tenant's), or the one named."""
        retain_s = retain_s or self.config.default_s
        until = self.clock() + retain_s
        promoting = in_pool = spaces = 0
        for ns in self._of(tenant):
            if namespace_id and ns.id != namespace_id:
                continue
            mgr = ns.mgr
            r = mgr.retention
            wanted = list(dict.fromkeys(keys)) if keys else r.below_keys(tag)
            here = [mgr.table.key_of(s) for s in r.by_tag.get(tag, ())] if not keys else \
                [k for k in wanted if mgr.table.find(k) >= 0]
            if not wanted and not here:
                continue
            self._count(ns)
            spaces += 1
            if here and self.config.max_share > 0:
                mgr.retain(here, tag, until, self.room(ns))
                in_pool += len(here)
            below = [k for k in wanted if mgr.table.find(k) < 0]
            if self.promote is None or not below:
                continue
            job = PrewarmJob(ns, below, tag, until, self.clock() + PREWARM_S)
            self._step(job)
            promoting += len(job.started) + len(job.keys)
            if job.keys:                          # the rest waits for free slots
                if len(self._jobs) >= MAX_PREWARM_JOBS:
                    self._jobs.pop(0)
                self._jobs.append(job)
        log.info("agent session %r prewarmed: %d blocks promoting, %d in the pool already, "
                 "%d namespaces", tag, promoting, in_pool, spaces)
        return PrewarmAnswer(promoting, in_pool, spaces)

    def _step(self, job: PrewarmJob) -> bool:
        """Promote what `job` still waits for, as far as slots are free; True when it is
        over (every key promoted, in the pool, or no longer held below)."""
        assert self.promote is not None
        ns = job.ns
        started = self.promote(ns, job.keys)
        new = [k for k in job.keys if k in started and k not in job.started]
        if new:
            job.started.update(new)
            r = ns.mgr.retention
            r.mark_prewarmed(new)
            room = self.room(ns) - len(r.arriving)
            if self.config.max_share > 0 and room > 0:
                r.expect(new[:room], job.tag, job.until)
            r.counters.prewarmed_total += len(new)
        find = ns.mgr.table.find
        # Left: not started and still not in the pool; a key the tier no longer holds is
        # never started (promote skips it): the job's deadline ends it.
        job.keys = [k for k in job.keys if k not in started and find(k) < 0]
        return not job.keys

    @property
    def prewarming(self) -> bool:
        """Prewarms wait for free slots (`prewarm_tick` is worth a call)."""
        return bool(self._jobs)

    def prewarm_tick(self) -> None:
        """Prewarms waiting for slots try again: at the sweep, and as engines' turns free
        the slots evicted for them (the channel's refill asks, at most every PREWARM_TICK_S)."""
        now = self.clock()
        if now - self._last_tick >= PREWARM_TICK_S:
            self._last_tick = now
            self._prewarms()

    def _prewarms(self) -> None:
        """Prewarms waiting for slots try again."""
        now = self.clock()
        for job in list(self._jobs):
            if job.ns.slots.closed or now > job.deadline or self._step(job):
                self._jobs.remove(job)

    def quota_bytes(self, tenant: str) -> int:
        """What `tenant`'s retained blocks may occupy: retention.max_share of its pool
        share (its quota, else the whole pool)."""
        return int((self.tenants.quota_of(tenant) or self.pool_size) * self.config.max_share)

    def room(self, ns: Namespace) -> int:
        """Blocks of `ns` its tenant may still retain: its quota left, and what is left of
        retention.max_share of the whole pool (tenants without a quota each have the pool as
        their share: together they never retain more than that), in `ns`'s block size."""
        mine = every = 0                          # one pass over the namespaces
        for n in self.namespaces:
            held = len(n.mgr.retention) * n.slots.stride
            every += held
            if n.tenant == ns.tenant:
                mine += held
        left = min(self.quota_bytes(ns.tenant) - mine,
                   int(self.pool_size * self.config.max_share) - every)
        return max(0, left // max(1, ns.slots.stride))

    def _of(self, tenant: str | None) -> Iterable[Namespace]:
        return (ns for ns in self.namespaces if tenant is None or ns.tenant == tenant)

    # ---------------------------------------------------------------- sessions
    def sweep(self) -> int:
        """Retained blocks whose hints ran out become ordinary blocks; how many."""
        now = self.clock()
        if self._jobs:
            self._prewarms()
        return sum(ns.mgr.expire(now) for ns in self.namespaces if ns.mgr.retention)

    def release(self, tag: str, tenant: str | None) -> tuple[int, int]:
        """Agent session `tag` of `tenant` (None: every tenant's, for an operator) is done:
        its blocks stop being retained at once. (blocks, namespaces) it had blocks in."""
        blocks = spaces = 0
        released = self._released
        released.pop((tenant, tag), None)
        released[(tenant, tag)] = self.clock()
        while len(released) > MAX_RELEASED:
            del released[next(iter(released))]
        for ns in self._of(tenant):
            n = ns.mgr.release_tag(tag)
            if n:
                blocks += n
                spaces += 1
        if blocks:
            log.info("agent session %r released: %d retained blocks in %d namespaces", tag,
                     blocks, spaces)
        return blocks, spaces

    def sessions(self, tenant: str | None, tag: str | None = None,
                 limit: int = MAX_TAGS_LISTED) -> list[RetainedSession]:
        """Agent sessions with retained blocks, per namespace, of `tenant` (None: all), or
        only session `tag`; at most `limit` rows, most blocks first."""
        now = self.clock()
        rows = []
        for ns in self._of(tenant):
            for view in ns.mgr.retention.tags():
                if tag is None or view.tag == tag:
                    rows.append(RetainedSession(
                        view.tag, ns.tenant, ns.id, ns.model, view.retained,
                        view.retained * ns.slots.stride,
                        max(0.0, view.until - now) if view.retained else 0.0, view.tagged,
                        view.below))
        rows.sort(key=lambda r: (-r.blocks, r.tag, r.namespace_id))
        return rows[:limit]

    def tenant_rows(self) -> dict[str, dict[str, int]]:
        """Per tenant whose requests hinted: the stats document's `retention` rows."""
        out: dict[str, dict[str, int]] = {}
        for tenant, c in self.counters.items():
            out[tenant] = {
                "retained_blocks": 0, "retained_bytes": 0, "sessions": 0,
                "retained_blocks_total": c.retained_total, "cut_blocks_total": c.cut_total,
                "expired_blocks_total": c.expired_total,
                "released_blocks_total": c.released_total,
                "gave_way_blocks_total": c.gave_way_total,
                "prewarmed_blocks_total": c.prewarmed_total,
                "prewarm_hits_total": c.prewarm_hits_total}
        for ns in self.namespaces:
            r = ns.mgr.retention
            row = out.get(ns.tenant)
            if row is None or not r:
                continue
            row["retained_blocks"] += len(r)
            row["retained_bytes"] += len(r) * ns.slots.stride
            row["sessions"] += len(set(r.by_tag) | set(r.below))
        return out
