"""The stats snapshot: everything `kvd stats`, KvdAdmin.Stats and /metrics show, built once.

One typed document in named sections (like Redis's INFO). `build_snapshot` reads the core
and the daemon's parts; the JSON answer (`to_dict`), the CLI table (`from_dict` on the
client's side) and the Prometheus collector all read the same attributes, so a renamed field
is renamed everywhere at once. docs/internals.md shows the JSON.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from kvd_server import __version__
from kvd_server.core import KvdCore
from kvd_server.namespaces import Namespace


@dataclass(slots=True)
class ServerStats:
    version: str = ""
    pid: int = 0
    uptime_seconds: float = 0.0
    state: str = ""
    policy: str = ""
    instance_id: str = ""
    socket: str = ""
    attach_socket: str = ""


@dataclass(slots=True)
class PoolStats:
    total_bytes: int = 0
    used_bytes: int = 0
    free_bytes: int = 0
    backing: str = ""
    path: str | None = None
    extent_bytes: int = 0
    extents_total: int = 0
    extents_free: int = 0
    prefault_bytes_done: int = 0
    mlocked: bool = False
    quarantined_slots: int = 0     # slots ended sessions may still be writing
    quarantined_pins: int = 0      # blocks ended sessions may still be reading


@dataclass(slots=True)
class BlockStats:
    """Blocks by state; a block is in exactly one of storing, ready, pinned."""

    storing: int = 0
    ready: int = 0
    pinned: int = 0
    zombie: int = 0

    def add(self, other: BlockStats) -> None:
        self.storing += other.storing
        self.ready += other.ready
        self.pinned += other.pinned
        self.zombie += other.zombie


@dataclass(slots=True)
class BlockTotals(BlockStats):
    total: int = 0


@dataclass(slots=True)
class ClientStats:
    active: int = 0
    attached_total: int = 0
    reaped_total: int = 0
    closed_total: int = 0


@dataclass(slots=True)
class OffloadCounters:
    """Counters a namespace row and the daemon's totals share."""

    lookups_total: int = 0
    hits_total: int = 0
    misses_total: int = 0
    stores_started_total: int = 0
    stores_completed_total: int = 0
    stores_failed_total: int = 0
    evictions_total: int = 0
    store_rejections_total: int = 0
    events_dropped_total: int = 0      # stored/removed events dropped: nobody took them


@dataclass(slots=True)
class ReclaimHolderStats:
    """The reader whose published epoch holds back the reuse of a namespace's freed slots
    (writers may be refused slots meanwhile); session_id "" when none does."""

    session_id: str = ""
    pid: int = 0
    live: bool = True               # False: an ended session whose process lives on
    held_seconds: float = 0.0       # since the oldest slot it holds back was freed
    published_epoch: int = 0
    waiting_epoch: int = 0
    slots_waiting: int = 0


@dataclass(slots=True)
class NamespaceStats(OffloadCounters):
    id: str = ""
    model: str = ""
    tenant: str = ""
    slot_bytes: int = 0
    block_bytes: int = 0
    num_ranks: int = 0
    slots_capacity: int = 0
    extents: int = 0
    epoch: int = 0
    sessions: int = 0
    blocks: BlockStats = field(default_factory=BlockStats)
    reclaim_holder: ReclaimHolderStats = field(default_factory=ReclaimHolderStats)


NAMESPACE_COUNTERS = tuple(f.name for f in dataclasses.fields(OffloadCounters))


@dataclass(slots=True)
class TenantStats:
    used_bytes: int = 0
    quota_bytes: int = 0    # 0: no quota


@dataclass(slots=True)
class Totals(OffloadCounters):
    """The `stats` section: counters over every namespace, plus pins and leases held now."""

    pins: int = 0
    leases: int = 0
    leases_expired_total: int = 0
    resets_total: int = 0
    step_calls_total: int = 0
    step_ops_total: int = 0


@dataclass(slots=True)
class TransferTotals:
    completed_load_bytes_total: int = 0    # counted by the daemon (block size x completions)
    completed_store_bytes_total: int = 0
    load_bytes_total: int = 0              # reported by clients
    load_seconds_total: float = 0.0
    store_bytes_total: int = 0
    store_seconds_total: float = 0.0


@dataclass(slots=True)
class RpcCount:
    calls_total: int = 0
    errors_total: int = 0


@dataclass(slots=True)
class ChannelStats:
    """The sessions' channels (the shared-index protocol without gRPC)."""

    open: int = 0
    native: bool = False                 # the index loops are compiled (kvd_proto/native.py)
    records_total: dict[str, int] = field(default_factory=dict)   # applied, by kind
    rejected_total: int = 0              # refused (answered REJECTED)
    broken_total: int = 0                # sessions ended for breaking their ring


@dataclass(slots=True)
class StatsSnapshot:
    server: ServerStats = field(default_factory=ServerStats)
    pool: PoolStats = field(default_factory=PoolStats)
    blocks: BlockTotals = field(default_factory=BlockTotals)
    sessions: int = 0
    clients: ClientStats = field(default_factory=ClientStats)
    namespaces: list[NamespaceStats] = field(default_factory=list)
    tenants: dict[str, TenantStats] = field(default_factory=dict)
    stats: Totals = field(default_factory=Totals)
    transfers: TransferTotals = field(default_factory=TransferTotals)
    channels: ChannelStats = field(default_factory=ChannelStats)
    rpc: dict[str, RpcCount] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (KvdAdmin.Stats, `kvd stats --json`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> StatsSnapshot:
        """Read a document back (the CLI's side); fields it lacks keep their defaults, fields
        it does not know (a newer daemon's) are ignored."""
        return _load(cls, doc)


@dataclass(slots=True, frozen=True)
class DaemonFacts:
    """What only the assembled daemon knows: its sockets, the pool's backing and progress, the
    RPC layer's counts."""

    socket: str = ""
    attach_socket: str = ""
    backing: str = ""
    path: str | None = None
    prefault_bytes_done: int = 0
    mlocked: bool = False
    step_calls_total: int = 0
    step_ops_total: int = 0
    rpc: dict[str, RpcCount] = field(default_factory=dict)
    channels: ChannelStats = field(default_factory=ChannelStats)


def build_snapshot(core: KvdCore, facts: DaemonFacts | None = None) -> StatsSnapshot:
    """The whole document from the core (and the daemon's facts, when assembled)."""
    facts = facts or DaemonFacts()
    ext = core.extents
    totals = Totals()
    blocks = BlockTotals()
    namespaces = []
    for ns in core.namespaces:
        c = ns.mgr.counts()
        ns_blocks = BlockStats(c.storing, c.ready, c.pinned, c.zombie)
        blocks.add(ns_blocks)
        mc = ns.mgr.counters
        row = NamespaceStats(
            id=ns.id, model=ns.model, tenant=ns.tenant, slot_bytes=ns.slots.stride,
            block_bytes=ns.layout.block_bytes, num_ranks=ns.layout.num_ranks,
            slots_capacity=ns.slots.capacity(), extents=ns.slots.extents_held(),
            epoch=ns.epoch, sessions=ns.sessions, blocks=ns_blocks,
            lookups_total=ns.lookups_total, hits_total=ns.hits_total,
            misses_total=ns.misses_total, stores_started_total=mc.stores_started_total,
            stores_completed_total=mc.stores_completed_total,
            stores_failed_total=mc.stores_failed_total, evictions_total=mc.evictions_total,
            store_rejections_total=mc.store_rejections_total,
            events_dropped_total=mc.events_dropped_total,
            reclaim_holder=reclaim_holder(ns))
        for name in NAMESPACE_COUNTERS:
            setattr(totals, name, getattr(totals, name) + getattr(row, name))
        namespaces.append(row)
    blocks.total = blocks.storing + blocks.ready + blocks.pinned
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
                       quarantined_pins=core.quarantine.pins_held()),
        blocks=blocks,
        sessions=len(sessions),
        clients=ClientStats(active=len(sessions), attached_total=sessions.attached_total,
                            reaped_total=sessions.reaped_total,
                            closed_total=sessions.closed_total),
        namespaces=namespaces,
        tenants={b.tenant: TenantStats(b.held * ext.extent_bytes,
                                       (b.max_extents or 0) * ext.extent_bytes)
                 for b in core.namespaces.budgets()},
        stats=totals,
        transfers=TransferTotals(
            completed_load_bytes_total=core.completed_load_bytes,
            completed_store_bytes_total=core.completed_store_bytes,
            load_bytes_total=t.load_bytes, load_seconds_total=t.load_seconds,
            store_bytes_total=t.store_bytes, store_seconds_total=t.store_seconds),
        channels=facts.channels,
        rpc=dict(sorted(facts.rpc.items())),
    )


def reclaim_holder(ns: Namespace) -> ReclaimHolderStats:
    """Who holds back the reuse of `ns`'s freed slots (kvd_server/shm_index.Reclamation)."""
    h = ns.reclaim.holder() if ns.reclaim is not None else None
    if h is None:
        return ReclaimHolderStats()
    return ReclaimHolderStats(h.session_id, h.pid, h.live, h.held_seconds, h.published_epoch,
                              h.waiting_epoch, h.slots_waiting)


def _load(cls: type, value: Any) -> Any:
    """Build dataclass `cls` from a JSON value, recursively, by its type hints."""
    if not isinstance(value, dict):
        return cls()
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in value:
            kwargs[f.name] = _convert(hints[f.name], value[f.name])
    return cls(**kwargs)


def _convert(hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _load(hint, value)
    if origin is list:
        (item,) = typing.get_args(hint)
        return [_convert(item, v) for v in value] if isinstance(value, list) else []
    if origin is dict:
        _, item = typing.get_args(hint)
        return {str(k): _convert(item, v) for k, v in value.items()} \
            if isinstance(value, dict) else {}
    return value
