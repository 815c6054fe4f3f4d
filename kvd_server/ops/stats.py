"""The stats snapshot: everything `kvd stats`, KvdAdmin.Stats and /metrics show, built once.

One typed document in named sections (like Redis's INFO). `build_snapshot`
(kvd_server/ops/snapshot.py) reads the core and the daemon's parts; the JSON answer (`to_dict`),
the CLI table (`from_dict` on the client's side) and the Prometheus collector all read the
same attributes, so a renamed field is renamed everywhere at once. This module is the schema
only: the CLI imports it without the core. docs/internals.md shows the JSON.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from kvd_server.tiers.base import TierStats


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
    quarantined_pins: int = 0      # load pins and leases of ended sessions (blocks they may
                                   # still be reading)


@dataclass(slots=True)
class BlockStats:
    """Blocks by state; a block is in exactly one of storing, ready, pinned, retained."""

    storing: int = 0
    ready: int = 0
    pinned: int = 0
    zombie: int = 0
    retained: int = 0       # kept by an agent session's retention hint (docs/agents.md)

    def add(self, other: BlockStats) -> None:
        self.storing += other.storing
        self.ready += other.ready
        self.pinned += other.pinned
        self.zombie += other.zombie
        self.retained += other.retained


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
    blocks_restored_total: int = 0     # evicted blocks an engine took back from its reserve
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
class RetentionTenantStats:
    """One tenant's retained blocks against its quota (retention.max_share of its pool share),
    and what its hints did."""

    retained_blocks: int = 0
    retained_bytes: int = 0
    quota_bytes: int = 0
    sessions: int = 0                   # agent sessions (tags) with retained blocks
    retained_blocks_total: int = 0      # blocks that became retained
    cut_blocks_total: int = 0           # asked for past the quota: not retained
    expired_blocks_total: int = 0       # their hint ran out
    released_blocks_total: int = 0      # their session was released
    gave_way_blocks_total: int = 0      # evicted anyway: no other victim was left
    prewarmed_blocks_total: int = 0     # promoted into the pool by prewarms
    prewarm_hits_total: int = 0         # prewarmed blocks an engine then loaded


@dataclass(slots=True)
class RetentionStats:
    """Agent sessions' retention hints (docs/agents.md)."""

    hints_total: int = 0                # hints taken (one per hinted request)
    hints_refused_total: int = 0        # malformed hints refused (the request went on)
    tenants: dict[str, RetentionTenantStats] = field(default_factory=dict)


@dataclass(slots=True)
class TenantIndexStats:
    """A tenant's namespaces' indexes in shared memory, against tenants.max_index_memory."""

    bytes: int = 0
    limit_bytes: int = 0        # 0: no limit
    refused_total: int = 0      # new namespaces refused for the limit


@dataclass(slots=True)
class IndexMemoryStats:
    """The shared memory of the namespaces' indexes (each sized for the whole pool): what
    engines that come and go could otherwise leave behind."""

    bytes: int = 0
    namespaces_forgotten_total: int = 0     # empty namespaces forgotten, their index closed
    tenants: dict[str, TenantIndexStats] = field(default_factory=dict)


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
    native_forced: bool = False          # not compiled because KVD_NATIVE=0 forced the twins
    records_total: dict[str, int] = field(default_factory=dict)   # applied, by kind
    rejected_total: int = 0              # refused (answered REJECTED)
    broken_total: int = 0                # sessions ended for breaking their ring


@dataclass(slots=True)
class ConnectionStats:
    """The daemon's sockets: connections to the gRPC socket (its front door, which owns the
    socket and pipes each connection to gRPC) and requests on the attach socket."""

    open: int = 0                        # gRPC connections piped now
    refused_total: int = 0               # their uid held server.max_connections_per_uid
    idle_closed_total: int = 0           # no traffic for server.idle_timeout (or none at all)
    shed_total: int = 0                  # the idlest closed at the descriptor limit
    attach_refused_total: int = 0        # attach requests refused (the answer says why)


@dataclass(slots=True)
class RestartStats:
    """Warm restart (kvd_server/restart/): what this daemon adopted from its predecessor."""

    enabled: bool = False
    directory: str = ""
    adopted: bool = False               # it took over a predecessor's files
    adopted_at: float = 0.0             # unix time
    adopt_seconds: float = 0.0
    cold_reason: str = ""               # why it started cold ("": adopted, or a first start)
    blocks_adopted: int = 0
    namespaces_adopted: int = 0
    namespaces_dropped: int = 0         # whose index could not be adopted
    blocks_dropped: dict[str, int] = field(default_factory=dict)    # reason -> blocks
    previous_sessions: int = 0          # engines of the predecessor whose process still ran
    held_sessions: int = 0              # ... still holding what they may copy
    held_extents: int = 0               # free extents held back for them

    @property
    def blocks_dropped_total(self) -> int:
        return sum(self.blocks_dropped.values())


@dataclass(slots=True)
class StatsSnapshot:
    server: ServerStats = field(default_factory=ServerStats)
    pool: PoolStats = field(default_factory=PoolStats)
    blocks: BlockTotals = field(default_factory=BlockTotals)
    sessions: int = 0
    clients: ClientStats = field(default_factory=ClientStats)
    namespaces: list[NamespaceStats] = field(default_factory=list)
    tenants: dict[str, TenantStats] = field(default_factory=dict)
    index_memory: IndexMemoryStats = field(default_factory=IndexMemoryStats)
    stats: Totals = field(default_factory=Totals)
    transfers: TransferTotals = field(default_factory=TransferTotals)
    channels: ChannelStats = field(default_factory=ChannelStats)
    connections: ConnectionStats = field(default_factory=ConnectionStats)
    restart: RestartStats = field(default_factory=RestartStats)
    retention: RetentionStats = field(default_factory=RetentionStats)
    tiers: list[TierStats] = field(default_factory=list)     # below the pool (disk)
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
    """What only the assembled daemon knows: its sockets (and their connections), the pool's
    backing and progress, the RPC layer's counts."""

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
    connections: ConnectionStats = field(default_factory=ConnectionStats)
    restart: RestartStats = field(default_factory=RestartStats)
    tiers: list[TierStats] = field(default_factory=list)


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
