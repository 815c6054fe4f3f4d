"""A daemon's warm restart: keeping its files as it runs, adopting a predecessor's at start.

`WarmRestart` is the daemon's one object for it (kvd_server/restart/__init__.py says what is
kept where). While the daemon runs it puts the tenants' pool files and the namespaces'
indexes in the directory, keeps the record in step as namespaces come and go, and keeps a
file per engine session. At start it reads what a previous daemon left and either adopts it
(`adopt`) or starts cold, saying why in one line.

Adopting is safe against everything the previous daemon's engines may still do, since they
map the same files: READY blocks keep their slots and bytes (a load in flight copies what it
looked up); every other slot of an adopted extent waits in its namespace's limbo, and every
free extent is held back, until each engine of the previous daemon whose process still runs
(pid and start time, not a bare pid) has said its copies are done (ReleaseHeld from its new
session), has exited, or has run a new session for `restart.hold_timeout`. Engines that died
while the daemon was down hold nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvd_server.core.namespaces import Held, Namespace
from kvd_server.core.peer import process_start, same_process
from kvd_server.memory.extents import ExtentAllocator, slot_geometry
from kvd_server.memory.pool import HostPool
from kvd_server.memory.shm_index import ShmIndex
from kvd_server.ops.stats import RestartStats
from kvd_server.restart.adopt import check_index
from kvd_server.restart.fdstore import FdStore
from kvd_server.restart.state import Keeper, Manifest, NamespaceRecord, SessionRecord, StateDir

if TYPE_CHECKING:
    from kvd_server.config import Config
    from kvd_server.core.core import KvdCore
    from kvd_server.core.sessions import Session

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Predecessor:
    """An engine session of the previous daemon whose process was still running."""

    session: str
    pid: int
    start: int
    namespace: str
    held: bool                          # its namespace was adopted: the quarantine holds it
    seen_again: float | None = None     # when a new session of its process was first seen


class WarmRestart:
    """The warm-restart files of one daemon (see the module doc)."""

    def __init__(self, config: Config, *, cold: bool = False) -> None:
        self.config = config
        self.dir: Keeper = FdStore() if config.restart.store == "systemd" else \
            StateDir(config.restart.directory, memory_only=True)
        self.dir.prepare()
        self.backing = "memfd" if config.restart.store == "systemd" else "file"
        self.stats = RestartStats(enabled=True, directory=self.dir.where)
        self._previous: Manifest | None = None
        self._cold = cold
        self._manifest: Manifest | None = None     # set by `begin`, once extents are known
        self._predecessors: list[_Predecessor] = []
        self._held_back: list[int] = []
        self._ended_held: set[str] = set()        # ended sessions whose process holds

    # ------------------------------------------------------------------ start
    @classmethod
    def open(cls, config: Config, pool_size: int, *, cold: bool = False) -> WarmRestart | None:
        """restart.warm: the store checked, what a previous daemon left read (adopted later
        by `adopt`, or removed for a cold start); None when off. StateError when the store
        cannot be used."""
        if not config.restart.warm:
            if cold:
                log.info("--cold: restart.warm is off, every start is cold")
            return None
        warm = cls(config, cold=cold)
        warm.begin(pool_size, ExtentAllocator(pool_size, config.pool.extent_size).extent_bytes)
        return warm

    @property
    def adopting(self) -> bool:
        """A previous daemon's files are being adopted (their memory is in use already)."""
        return self._previous is not None

    def tenants_to_adopt(self) -> list[str]:
        """Tenants whose pool files the previous daemon left: opened at start, so that their
        namespaces' blocks are adopted with the bytes they index."""
        return sorted(self._previous.tenants) if self._previous is not None else []

    def begin(self, pool_size: int, extent_bytes: int) -> None:
        """Read what a previous daemon left; decide to adopt it or start cold (logged)."""
        reason = ""
        previous: Manifest | None = None
        try:
            previous = self.dir.read()
        except ValueError as exc:
            reason = f"its state record is unreadable: {exc}"
        if previous is not None and not reason:
            reason = previous.unservable(pool_size, extent_bytes) or ""
        if self._cold and previous is not None:
            reason = "kvd serve --cold"
        if previous is None and not reason:
            log.info("warm restart: nothing to adopt in %s (a first start)", self.dir.where)
        elif reason:
            removed = self.dir.clear()
            self.stats.cold_reason = reason
            log.warning("warm restart: starting cold, %s; removed the %d files the previous "
                        "daemon left in %s", reason, removed, self.dir.where)
            previous = None
        self._previous = previous
        # What is adopted stays on record from the start: a daemon killed while it adopts
        # leaves the same record to the next one.
        self._manifest = Manifest(
            pool_size=pool_size, extent_bytes=extent_bytes,
            tenants=dict(previous.tenants) if previous else {},
            namespaces=dict(previous.namespaces) if previous else {})
        if previous is None:
            self.dir.clear_sessions()
            self.dir.write(self._manifest)

    # ------------------------------------------------------------------ files (TenantPools)
    def pool(self, tenant: str, size: int) -> HostPool:
        """The tenant's pool file: the previous daemon's, as it left it, or a fresh one."""
        assert self._manifest is not None, "begin() first"
        adopt_id = self._previous.tenants.get(tenant, "") if self._previous else ""
        pool = self.dir.pool(tenant, size, adopt_id)
        self._manifest.tenants[tenant] = pool.pool_id
        self.dir.write(self._manifest)
        return pool

    # ------------------------------------------------------------------ files (NamespaceTable)
    def index(self, ns_id: str, capacity: int, key_width: int, per_extent: int, stride: int,
              extent_bytes: int) -> ShmIndex:
        return self.dir.index(ns_id, (capacity, key_width, per_extent, stride, extent_bytes),
                              adopt=False)

    def policy_memory(self, ns_id: str, nbytes: int, *, adopt: bool) -> object | None:
        """Where the namespace's policy keeps its order (LRU's ranks), beside its index: the
        previous daemon's when adopting (None if it cannot be had: the order restarts)."""
        try:
            return self.dir.policy_memory(ns_id, nbytes, adopt=adopt)
        except (OSError, ValueError) as exc:
            log.warning("warm restart: namespace %s keeps its eviction order in memory of its "
                        "own (%s)", ns_id, exc)
            return None

    def created(self, ns: Namespace) -> None:
        assert self._manifest is not None
        self._manifest.namespaces[ns.id] = NamespaceRecord.of(ns.id, ns.model, ns.layout,
                                                              ns.salt, ns.tenant)
        self._write(f"namespace {ns.id} is new")
        ns.mgr.retention.on_new_tag = lambda: self._tags_changed(ns)

    def _write(self, why: str) -> None:
        """The record, replaced; a directory that cannot take it (removed, read-only, full)
        is said, not raised: the daemon serves on, and a restart may start cold."""
        assert self._manifest is not None
        try:
            self.dir.write(self._manifest)
        except OSError as exc:
            log.warning("warm restart: the record in %s is not up to date (%s: %s); a "
                        "restarted daemon may start cold", self.dir.where, why,
                        exc.strerror or exc)

    def _tags_changed(self, ns: Namespace) -> None:
        """An agent session's tag got an id in `ns`: on record, so a restarted daemon names
        the retained blocks' sessions again (kvd_server/manager/retention.py)."""
        manifest = self._manifest
        record = manifest.namespaces.get(ns.id) if manifest is not None else None
        if manifest is None or record is None:
            return
        manifest.namespaces[ns.id] = dataclasses.replace(
            record, tags=tuple(ns.mgr.retention.tag_names))
        self._write(f"namespace {ns.id} names a new agent session")

    def forgotten(self, ns: Namespace) -> None:
        assert self._manifest is not None
        self._manifest.namespaces.pop(ns.id, None)
        self._write(f"namespace {ns.id} forgotten")
        try:
            self.dir.drop_index(ns.id, ns.index)
        except OSError as exc:
            log.warning("warm restart: namespace %s's files in %s stay (%s)", ns.id,
                        self.dir.where, exc.strerror or exc)

    # ------------------------------------------------------------------ sessions (KvdCore)
    def registered(self, s: Session, ns: Namespace) -> None:
        """A session joins `ns`: on record before it can be granted a slot."""
        self.dir.record_session(SessionRecord(s.id, ns.id, s.peer.pid,
                                              process_start(s.peer.pid), s.peer.uid))

    def ended(self, s: Session, held: bool) -> None:
        """A session ended; while its process holds what it may copy, its record stays."""
        if held:
            self._ended_held.add(s.id)
        else:
            self.dir.forget_session(s.id)

    # ------------------------------------------------------------------ adoption
    def adopt(self, core: KvdCore) -> None:
        """Take over the previous daemon's namespaces, blocks and engines (see the module
        doc). Call once, after the pools exist and before serving."""
        previous, manifest = self._previous, self._manifest
        if previous is None or manifest is None:
            return
        started = time.monotonic()
        checked: list[tuple[Namespace, np.ndarray]] = []
        for record in previous.namespaces.values():
            ns = self._adopt_index(core, record)
            if ns is None:
                manifest.namespaces.pop(record.id, None)
                continue
            check = check_index(ns.index)     # type: ignore[arg-type]
            for why, n in check.dropped.items():
                self._dropped(why, n)
            checked.append((ns, check.ready))
        claims = _claims(checked)
        for ns, ready in checked:
            kept = self._adopt_extents(ns, ready, claims)
            ns.mgr.adopt(kept)
            self.stats.blocks_adopted += len(kept)
            self.stats.namespaces_adopted += 1
        self.dir.write(manifest)
        self._take_over_sessions(core, {ns.id: ns for ns, _ in checked})
        for ns, _ in checked:
            ns.release_extents()
        self.stats.adopted = True
        self.stats.adopted_at = time.time()
        self.stats.adopt_seconds = time.monotonic() - started
        dropped = self.stats.blocks_dropped_total
        log.info("warm restart: adopted %d blocks in %d namespaces from %s in %.3f s%s; "
                 "%d engines of the previous daemon still run (what they may copy is held "
                 "until they are done)", self.stats.blocks_adopted,
                 self.stats.namespaces_adopted, self.dir.where, self.stats.adopt_seconds,
                 "" if not dropped else f"; dropped {dropped} blocks ("
                 + ", ".join(f"{n} {why}" for why, n in self.stats.blocks_dropped.items())
                 + ")", len(self._predecessors))

    def _adopt_index(self, core: KvdCore, record: NamespaceRecord) -> Namespace | None:
        """The namespace of `record` over its index file, or None (its blocks dropped, said)."""
        table = core.namespaces
        extent_bytes = table.extents.extent_bytes
        try:
            layout = record.layout
            stride, per_extent = slot_geometry(extent_bytes, layout.block_bytes)
            index = self.dir.index(record.id, (table.extents.total * per_extent,
                                               layout.index_key_width, per_extent, stride,
                                               extent_bytes), adopt=True)
        except (OSError, ValueError, TypeError) as exc:
            log.warning("warm restart: namespace %s (%s) starts empty: its index cannot be "
                        "adopted (%s)", record.id, record.model, exc)
            self.stats.namespaces_dropped += 1
            self.dir.drop_index(record.id, None)
            return None
        ns = table.make(record.id, record.model, layout, record.salt, record.tenant,
                        index=index)
        if record.tags and self._manifest is not None:     # retained blocks' sessions
            ns.mgr.retention.load_tags(record.tags)
            made = self._manifest.namespaces.get(ns.id)
            if made is not None:
                self._manifest.namespaces[ns.id] = dataclasses.replace(made, tags=record.tags)
        return ns

    def _adopt_extents(self, ns: Namespace, ready: np.ndarray,
                       claims: dict[int, int]) -> np.ndarray:
        """Hold again the extents `ready` lies in; the READY slots kept (the others dropped:
        an extent two namespaces claim, or one the tenant's quota cannot hold). Each extent's
        idle slots go to it as one array: what this costs follows the extents and the blocks,
        never a Python object per slot of the pool (64 GiB of 4 KiB blocks is 16M slots)."""
        slots, index = ns.slots, ns.index
        assert index is not None
        per = slots.per_extent
        keep = np.ones(len(ready), dtype=bool)
        # Slot ids of 4 bytes where they fit (they do below 8 TiB of 4 KiB slots): the idle
        # slots wait as arrays, 4 bytes each.
        ids = np.int32 if index.header.capacity <= np.iinfo(np.int32).max else np.int64
        extents, starts, counts = _extent_runs(ready, per)
        for extent, start, count in zip(extents.tolist(), starts.tolist(), counts.tolist(),
                                        strict=True):
            reason = ""
            if claims.get(extent, 0) > 1:
                reason = "extent claimed by two namespaces"
            else:
                base = extent * per
                idle = np.ones(per, dtype=bool)
                idle[ready[start:start + count] - base] = False
                idle_slots = np.flatnonzero(idle).astype(ids) + ids(base)
                if not slots.adopt_extent(extent, count, idle_slots):
                    reason = "tenant quota"
            if reason:
                keep[start:start + count] = False
                for slot in ready[start:start + count].tolist():
                    index.remove(slot)
                self._dropped(reason, count)
        return ready[keep]

    def _take_over_sessions(self, core: KvdCore, adopted: dict[str, Namespace]) -> None:
        """The previous daemon's engines whose process still runs hold what they may copy."""
        now = core.clock()
        for record in self.dir.old_sessions():
            if record.pid > 0 and not same_process(record.pid, record.start):
                self.dir.forget_session(record.session)   # died while it was down: holds
                continue                                  # nothing
            ns = adopted.get(record.namespace)
            held = ns is not None and ns.reclaim is not None
            # A process in another pid namespace (pid 0) cannot be watched: it holds for
            # restart.hold_timeout from now.
            self._predecessors.append(_Predecessor(record.session, record.pid, record.start,
                                                   record.namespace, held,
                                                   None if record.pid > 0 else now))
            if ns is not None and ns.reclaim is not None:
                ns.reclaim.hold(record.session, record.pid, ns.reclaim.index.reclaim_epoch)
                core.quarantine.hold(Held(ns, record.session, record.pid, now, [], [],
                                          reader=True, start=record.start))
            # Their records stay until they are released (a crash meanwhile: held again).
            self._ended_held.add(record.session)
        self.stats.previous_sessions = len(self._predecessors)
        if self._predecessors:
            self._held_back = core.extents.hold_back()
        self._update_held()

    # ------------------------------------------------------------------ while serving
    def sweep(self, core: KvdCore) -> None:
        """Release what the previous daemon's engines no longer need, and the records of
        sessions nobody holds any more. Called by the daemon's sweeper."""
        if self._predecessors:
            now = core.clock()
            pids = {s.peer.pid for s in core.sessions if s.ns is not None}
            keep = []
            for p in self._predecessors:
                gone = p.pid > 0 and not same_process(p.pid, p.start)
                released = p.held and not core.quarantine.holds(p.session, p.pid)
                if (p.pid in pids or p.pid <= 0) and not gone and not released:
                    if p.seen_again is None:
                        p.seen_again = now
                    elif now - p.seen_again >= self.config.restart.hold_timeout:
                        log.info("warm restart: engine pid %d (session %s of the previous "
                                 "daemon) attached again %.0f s ago and did not say its "
                                 "copies are done: released what it held", p.pid, p.session,
                                 now - p.seen_again)
                        if p.held:
                            core.quarantine.release_session(p.session, p.pid)
                        released = True
                if gone or released:
                    if gone:
                        core.quarantine.release_due()
                    continue
                keep.append(p)
            self._predecessors = keep
            if not keep and self._held_back:
                for extent in reversed(self._held_back):
                    core.extents.give(extent)
                log.info("warm restart: every engine of the previous daemon is done; %d free "
                         "extents back in use", len(self._held_back))
                self._held_back = []
            self._update_held()
        if self._ended_held:
            for session_id in list(self._ended_held):
                if not core.quarantine.holds(session_id):
                    self._ended_held.discard(session_id)
                    self.dir.forget_session(session_id)

    def _dropped(self, why: str, n: int) -> None:
        if n:
            drops = self.stats.blocks_dropped
            drops[why] = drops.get(why, 0) + n

    def _update_held(self) -> None:
        self.stats.held_sessions = len(self._predecessors)
        self.stats.held_extents = len(self._held_back)


def _claims(checked: list[tuple[Namespace, np.ndarray]]) -> dict[int, int]:
    """Extent -> how many namespaces have READY blocks in it."""
    claims: Counter[int] = Counter()
    for ns, ready in checked:
        claims.update(_extent_runs(ready, ns.slots.per_extent)[0].tolist())
    return dict(claims)


def _extent_runs(ready: np.ndarray, per: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(extent, first position, count) of each extent's run of the ascending slots `ready`:
    np.unique(ready // per, return_index=True, return_counts=True) in one pass, without its
    sort (and without numpy.ma, which np.unique imports)."""
    extents = ready // per
    if not len(extents):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    starts = np.flatnonzero(np.concatenate(([True], extents[1:] != extents[:-1])))
    counts = np.diff(np.append(starts, len(extents)))
    return extents[starts], starts, counts

