"""Builds the stats document (kvd_server/ops/stats.py, the schema) from the daemon's core.

Apart from the schema so that the CLI, which renders the document, imports neither the core
nor the manager (nor numpy): `kvd --help` and `kvd stats` stay quick to start.
"""

from __future__ import annotations

import dataclasses
import os

from kvd_server import __version__
from kvd_server.core.core import KvdCore
from kvd_server.core.namespaces import Namespace
from kvd_server.manager import ManagerCounters
from kvd_server.ops.stats import (
    NAMESPACE_COUNTERS,
    BlockStats,
    BlockTotals,
    ClientStats,
    DaemonFacts,
    IndexMemoryStats,
    NamespaceStats,
    PoolStats,
    ReclaimHolderStats,
    RetentionStats,
    RetentionTenantStats,
    ServerStats,
    StatsSnapshot,
    TenantIndexStats,
    TenantStats,
    Totals,
    TransferTotals,
)

# The manager's counters a namespace row carries as they are.
MANAGER_COUNTERS = tuple(f.name for f in dataclasses.fields(ManagerCounters)
                         if f.name in NAMESPACE_COUNTERS)


def build_snapshot(core: KvdCore, facts: DaemonFacts | None = None) -> StatsSnapshot:
    """The whole document from the core (and the daemon's facts, when assembled)."""
    facts = facts or DaemonFacts()
    ext = core.extents
    totals = Totals()
    blocks = BlockTotals()
    namespaces = []
    for ns in core.namespaces:
        c = ns.mgr.counts()
        ns_blocks = BlockStats(c.storing, c.ready, c.pinned, c.zombie, c.retained)
        blocks.add(ns_blocks)
        row = NamespaceStats(
            id=ns.id, model=ns.model, tenant=ns.tenant, slot_bytes=ns.slots.stride,
            block_bytes=ns.layout.block_bytes, num_ranks=ns.layout.num_ranks,
            slots_capacity=ns.slots.capacity(), extents=ns.slots.extents_held(),
            epoch=ns.epoch, sessions=ns.sessions, blocks=ns_blocks,
            lookups_total=ns.lookups_total, hits_total=ns.hits_total,
            misses_total=ns.misses_total, reclaim_holder=reclaim_holder(ns),
            **_manager_counters(ns.mgr.counters))
        for name in NAMESPACE_COUNTERS:
            setattr(totals, name, getattr(totals, name) + getattr(row, name))
        namespaces.append(row)
    blocks.total = blocks.storing + blocks.ready + blocks.pinned + blocks.retained
    sessions = core.sessions
    totals.pins = sum(s.pin_count() for s in sessions)
    totals.leases = sum(len(s.leases) for s in sessions)
    totals.leases_expired_total = core.leases_expired_total
    totals.resets_total = core.resets_total
    totals.step_calls_total = facts.step_calls_total
    totals.step_ops_total = facts.step_ops_total
    t = core.transfers
    config = core.config
    return StatsSnapshot(
        server=ServerStats(version=__version__, pid=os.getpid(),
                           uptime_seconds=core.clock() - core.started, state=core.state.value,
                           policy=config.manager.policy, instance_id=core.instance_id,
                           socket=facts.socket, attach_socket=facts.attach_socket),
        pool=PoolStats(total_bytes=ext.pool_bytes, used_bytes=ext.used_bytes,
                       free_bytes=ext.free_bytes, backing=facts.backing, path=facts.path,
                       extent_bytes=ext.extent_bytes, extents_total=ext.total,
                       extents_free=ext.free_extents(),
                       prefault_bytes_done=facts.prefault_bytes_done, mlocked=facts.mlocked,
                       quarantined_slots=core.quarantine.slots_held(),
                       quarantined_pins=core.quarantine.refs_held()),
        blocks=blocks,
        sessions=len(sessions),
        clients=ClientStats(active=len(sessions), attached_total=sessions.attached_total,
                            reaped_total=sessions.reaped_total,
                            closed_total=sessions.closed_total),
        namespaces=namespaces,
        tenants={b.tenant: TenantStats(b.held * ext.extent_bytes,
                                       (b.max_extents or 0) * ext.extent_bytes)
                 for b in core.namespaces.budgets()},
        index_memory=index_memory(core),
        stats=totals,
        transfers=TransferTotals(
            completed_load_bytes_total=core.completed_load_bytes,
            completed_store_bytes_total=core.completed_store_bytes,
            load_bytes_total=t.load_bytes, load_seconds_total=t.load_seconds,
            store_bytes_total=t.store_bytes, store_seconds_total=t.store_seconds),
        channels=facts.channels,
        connections=facts.connections,
        restart=facts.restart,
        retention=retention_stats(core),
        tiers=list(facts.tiers),
        rpc=dict(sorted(facts.rpc.items())),
    )


def retention_stats(core: KvdCore) -> RetentionStats:
    """Agent sessions' retention: per tenant whose requests hinted, against its quota."""
    r = core.retention
    return RetentionStats(
        r.hints_total, r.hints_refused_total,
        {tenant: RetentionTenantStats(**row, quota_bytes=r.quota_bytes(tenant))
         for tenant, row in sorted(r.tenant_rows().items())})


def index_memory(core: KvdCore) -> IndexMemoryStats:
    """The namespaces' indexes in shared memory, per tenant against its limit."""
    table = core.namespaces
    limit = core.config.tenants.max_index_memory
    tenants = {b.tenant: TenantIndexStats(0, limit, table.index_refused[b.tenant])
               for b in table.budgets()}
    total = 0
    for ns in table:
        row = tenants.setdefault(ns.tenant, TenantIndexStats(0, limit))
        row.bytes += ns.index_bytes
        total += ns.index_bytes
    return IndexMemoryStats(total, table.forgotten_total, tenants)


def _manager_counters(counters: object) -> dict[str, int]:
    """The manager's counters a namespace row shows, by their shared names (one list of
    counters: the stats schema's, kvd_server/ops/stats.py)."""
    return {name: getattr(counters, name) for name in MANAGER_COUNTERS}


def reclaim_holder(ns: Namespace) -> ReclaimHolderStats:
    """Who holds back the reuse of `ns`'s freed slots (kvd_server/shm_index.Reclamation)."""
    h = ns.reclaim.holder() if ns.reclaim is not None else None
    if h is None:
        return ReclaimHolderStats()
    return ReclaimHolderStats(h.session_id, h.pid, h.live, h.held_seconds, h.published_epoch,
                              h.waiting_epoch, h.slots_waiting)
