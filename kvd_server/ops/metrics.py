"""Prometheus exposition for the daemon.

State metrics (pool, blocks, namespaces, sessions, counters) are read from the stats snapshot
at scrape time by a custom collector, so the hot path pays nothing for them. Only what cannot be
read back later is observed as it happens: RPC latencies, step-batch sizes and the transfer
sizes that clients report. The standard `process_*` (resident memory, open descriptors, CPU)
and `python_*` (version, GC) series come from prometheus_client's own collectors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvd_server.ops.stats import (
    BlockStats,
    ChannelStats,
    ConnectionStats,
    IndexMemoryStats,
    NamespaceStats,
    PoolStats,
    RestartStats,
    RetentionStats,
    ServerStats,
    StatsSnapshot,
    TenantStats,
    TierStats,
    Totals,
    TransferTotals,
)

log = logging.getLogger(__name__)

# RPC latency: a unary Python RPC costs ~0.4 ms, a stream message ~0.2 ms (measured on a
# 2-core VM; bench/README.md).
RPC_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
# vLLM's kv_offload transfer size buckets, so dashboards built for vLLM read the same.
TRANSFER_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
STEP_OPS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_KEYS_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
# Namespace ids are bounded by the pool's extents, but cap the label set all the same.
MAX_NAMESPACE_LABELS = 64
STATES = ("starting", "serving", "draining")


class RpcMetrics:
    """Metrics observed on the request path (cheap: one histogram observe per call)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "kvd_rpc_duration_seconds",
            "Time to serve a gRPC call, by method.",
            ["method"],
            buckets=RPC_BUCKETS,
            registry=registry,
        )
        self.errors = Counter(
            "kvd_rpc_errors",
            "gRPC calls answered with a non-OK status, by method and status code.",
            ["method", "code"],
            registry=registry,
        )
        self.step_ops = Histogram(
            "kvd_step_batch_ops",
            "Operations carried by one Step call.",
            buckets=STEP_OPS_BUCKETS,
            registry=registry,
        )
        self.step_keys = Histogram(
            "kvd_step_batch_keys",
            "Keys carried by one Step call, over all its operations.",
            buckets=STEP_KEYS_BUCKETS,
            registry=registry,
        )
        self.transfer_size = Histogram(
            "kvd_transfer_size_bytes",
            "Bytes per transfer reported by clients (vLLM's buckets).",
            ["transfer_type"],
            buckets=TRANSFER_SIZE_BUCKETS,
            registry=registry,
        )

    def observe(self, method: str, seconds: float, code: str = "OK") -> None:
        self.duration.labels(method).observe(seconds)
        if code != "OK":
            self.errors.labels(method, code).inc()

    def observe_step(self, ops: int, keys: int) -> None:
        self.step_ops.observe(ops)
        self.step_keys.observe(keys)

    def observe_transfer(self, load_sizes: Iterable[int], store_sizes: Iterable[int]) -> None:
        load = self.transfer_size.labels("CPU_to_GPU")
        for size in load_sizes:
            load.observe(size)
        store = self.transfer_size.labels("GPU_to_CPU")
        for size in store_sizes:
            store.observe(size)


class StatsCollector(Collector):
    """Turns the stats snapshot (kvd_server.ops.stats) into metric families at scrape time."""

    def __init__(self, snapshot: Callable[[], StatsSnapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        # Unchecked registration: families depend on the live document.
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            snap = self._snapshot()
        except Exception:  # a scrape must never take the daemon down
            log.exception("stats snapshot failed during a scrape")
            yield GaugeMetricFamily("kvd_up", "1 when the daemon answered the scrape.", value=0)
            return
        yield GaugeMetricFamily("kvd_up", "1 when the daemon answered the scrape.", value=1)
        yield from _server(snap.server)
        yield from _pool(snap.pool)
        yield from _blocks(snap.blocks)
        yield from _sessions(snap)
        yield from _totals(snap.stats)
        yield from _namespaces(snap.namespaces)
        yield from _tenants(snap.tenants)
        yield from _transfers(snap.transfers)
        yield from _channels(snap.channels)
        yield from _connections(snap.connections)
        yield from _index_memory(snap.index_memory)
        yield from _restart(snap.restart)
        yield from _retention(snap.retention)
        yield from _tiers(snap.tiers)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=float(value))


def _server(server: ServerStats) -> Iterator[Metric]:
    info = InfoMetricFamily("kvd_build", "kvd version and eviction policy.")
    info.add_metric([], {"version": server.version, "policy": server.policy})
    yield info
    state = GaugeMetricFamily("kvd_state", "1 for the daemon's current state.", labels=["state"])
    for name in STATES:
        state.add_metric([name], 1.0 if name == server.state else 0.0)
    yield state
    yield _gauge("kvd_uptime_seconds", "Seconds since the daemon started.", server.uptime_seconds)


def _pool(pool: PoolStats) -> Iterator[Metric]:
    yield _gauge("kvd_pool_total_bytes", "Size of the shared host pool.", pool.total_bytes)
    yield _gauge("kvd_pool_used_bytes", "Pool bytes held by namespaces' extents.",
                 pool.used_bytes)
    yield _gauge("kvd_pool_free_bytes", "Pool bytes in free extents.", pool.free_bytes)
    yield _gauge("kvd_pool_extent_bytes", "Size of one extent (the unit a namespace grows by).",
                 pool.extent_bytes)
    yield _gauge("kvd_pool_prefault_bytes", "Pool bytes pre-faulted so far (progress at start).",
                 pool.prefault_bytes_done)
    yield _gauge("kvd_pool_mlocked", "1 when the pool is locked in RAM.", 1 if pool.mlocked else 0)


def _blocks(blocks: BlockStats) -> Iterator[Metric]:
    fam = GaugeMetricFamily("kvd_blocks", "Blocks in the pool by state.", labels=["state"])
    for state in BLOCK_STATES:
        fam.add_metric([state], float(getattr(blocks, state)))
    yield fam


def _sessions(snap: StatsSnapshot) -> Iterator[Metric]:
    clients = snap.clients
    yield _gauge("kvd_sessions", "Live engine sessions.", snap.sessions)
    yield _counter("kvd_sessions_attached", "Sessions attached since start.",
                   clients.attached_total)
    yield _counter("kvd_sessions_reaped", "Sessions ended by the liveness deadline.",
                   clients.reaped_total)
    yield _counter("kvd_sessions_closed", "Sessions ended by their client or a closed stream.",
                   clients.closed_total)


def _totals(totals: Totals) -> Iterator[Metric]:
    yield _gauge("kvd_pins", "Pins held by loads in flight.", totals.pins)
    yield _gauge("kvd_leases", "Lookup leases held.", totals.leases)
    yield _counter("kvd_leases_expired", "Leases that expired before a load used them.",
                   totals.leases_expired_total)
    yield _counter("kvd_resets", "Cache resets (engine or admin).", totals.resets_total)
    yield _counter("kvd_step_calls", "Batched Step calls served.", totals.step_calls_total)
    yield _counter("kvd_step_ops", "Operations carried by Step calls.", totals.step_ops_total)


_NS_COUNTERS = (
    ("kvd_lookups", "Keys looked up.", "lookups_total"),
    ("kvd_hits", "Lookups that found a readable block.", "hits_total"),
    ("kvd_misses", "Lookups that found nothing readable.", "misses_total"),
    ("kvd_evictions", "Blocks evicted to make room.", "evictions_total"),
    ("kvd_blocks_restored", "Evicted blocks an engine took back, intact, from the slots "
     "granted to it (readable again without a copy).", "blocks_restored_total"),
    ("kvd_store_rejections", "prepare_store calls answered 'cannot store'.",
     "store_rejections_total"),
    ("kvd_events_dropped", "Stored/removed events dropped unseen: nobody took them before "
     "the namespace's event queue reached its bound.", "events_dropped_total"),
)
BLOCK_STATES = ("storing", "ready", "pinned", "zombie", "retained")


def _namespaces(namespaces: Sequence[NamespaceStats]) -> Iterator[Metric]:
    rows = _bounded(namespaces)
    counters = {name: CounterMetricFamily(name, doc, labels=["namespace"])
                for name, doc, _ in _NS_COUNTERS}
    stores = CounterMetricFamily("kvd_stores", "Block stores by outcome.",
                                 labels=["namespace", "outcome"])
    info = InfoMetricFamily("kvd_namespace", "The model and tenant of a namespace id (join "
                                             "on `namespace` to name other series' lines).",
                            labels=["namespace"])
    slots = GaugeMetricFamily("kvd_namespace_slots", "Slots a namespace can hold now.",
                              labels=["namespace"])
    ns_blocks = GaugeMetricFamily("kvd_namespace_blocks", "Blocks of a namespace by state.",
                                  labels=["namespace", "state"])
    held = GaugeMetricFamily("kvd_namespace_reclaim_held_seconds",
                             "Seconds a reader's published epoch has held back the reuse of "
                             "the namespace's oldest freed slot (0: none held); kvd stats "
                             "names the reader.", labels=["namespace"])
    for label, ns in rows:
        info.add_metric([label], {"model": ns.model, "tenant": ns.tenant})
        for name, _, attr in _NS_COUNTERS:
            counters[name].add_metric([label], float(getattr(ns, attr)))
        for outcome, attr in (("started", "stores_started_total"),
                              ("completed", "stores_completed_total"),
                              ("failed", "stores_failed_total")):
            stores.add_metric([label, outcome], float(getattr(ns, attr)))
        slots.add_metric([label], float(ns.slots_capacity))
        for state in BLOCK_STATES:
            ns_blocks.add_metric([label, state], float(getattr(ns.blocks, state)))
        held.add_metric([label], ns.reclaim_holder.held_seconds)
    yield info
    yield from counters.values()
    yield stores
    yield slots
    yield ns_blocks
    yield held


def _tenants(tenants: dict[str, TenantStats]) -> Iterator[Metric]:
    """Pool use and quota per tenant. Tenants come from the configuration (plus "default"), so
    the label set is bounded by what the operator wrote; past MAX_NAMESPACE_LABELS, "other"."""
    used = GaugeMetricFamily("kvd_tenant_used_bytes",
                             "Pool bytes held by a tenant's namespaces (whole extents).",
                             labels=["tenant"])
    quota = GaugeMetricFamily("kvd_tenant_quota_bytes",
                              "A tenant's pool quota (tenants.quotas); 0: none.",
                              labels=["tenant"])
    names = sorted(tenants)
    for name in names[:MAX_NAMESPACE_LABELS]:
        used.add_metric([name], tenants[name].used_bytes)
        quota.add_metric([name], tenants[name].quota_bytes)
    rest = names[MAX_NAMESPACE_LABELS:]
    if rest:
        used.add_metric(["other"], sum(tenants[n].used_bytes for n in rest))
        quota.add_metric(["other"], sum(tenants[n].quota_bytes for n in rest))
    yield used
    yield quota


def _bounded(namespaces: Sequence[NamespaceStats]) -> list[tuple[str, NamespaceStats]]:
    """Namespaces as (label, values); past MAX_NAMESPACE_LABELS they add up under "other"."""
    rows = [(ns.id, ns) for ns in namespaces[:MAX_NAMESPACE_LABELS]]
    rest = namespaces[MAX_NAMESPACE_LABELS:]
    if rest:
        other = NamespaceStats(id="other", model="other", tenant="other")
        for ns in rest:
            for f in dataclasses.fields(NamespaceStats):
                value = getattr(ns, f.name)
                if isinstance(value, int) and not isinstance(value, bool):
                    setattr(other, f.name, getattr(other, f.name) + value)
            other.blocks.add(ns.blocks)
            other.reclaim_holder.held_seconds = max(other.reclaim_holder.held_seconds,
                                                    ns.reclaim_holder.held_seconds)
        rows.append(("other", other))
    return rows


def _transfers(transfers: TransferTotals) -> Iterator[Metric]:
    yield _counter("kvd_loaded_bytes",
                   "Bytes of blocks whose loads completed (block size x completed loads).",
                   transfers.completed_load_bytes_total)
    yield _counter("kvd_stored_bytes",
                   "Bytes of blocks whose stores completed (block size x completed stores).",
                   transfers.completed_store_bytes_total)
    yield _counter("kvd_transfer_load_bytes", "Bytes loaded pool->engine (client reports).",
                   transfers.load_bytes_total)
    yield _counter("kvd_transfer_store_bytes", "Bytes stored engine->pool (client reports).",
                   transfers.store_bytes_total)
    yield _counter("kvd_transfer_load_seconds", "Seconds spent loading (client reports).",
                   transfers.load_seconds_total)
    yield _counter("kvd_transfer_store_seconds", "Seconds spent storing (client reports).",
                   transfers.store_seconds_total)


def _channels(channels: ChannelStats) -> Iterator[Metric]:
    yield _gauge("kvd_channels", "Sessions' channels open (engines on the shared-index "
                 "protocol).", channels.open)
    records = CounterMetricFamily("kvd_channel_records", "Channel records applied, by kind.",
                                  labels=["kind"])
    for kind, n in sorted(channels.records_total.items()):
        records.add_metric([kind], float(n))
    yield records
    yield _counter("kvd_channel_rejected", "Channel records refused (answered REJECTED).",
                   channels.rejected_total)
    yield _counter("kvd_channels_broken", "Sessions ended for breaking their channel's rings.",
                   channels.broken_total)
    yield _gauge("kvd_native", "1 when the shared index's loops run compiled (kvd_proto."
                 "_native), 0 on the pure-Python twins.", 1 if channels.native else 0)


def _index_memory(mem: IndexMemoryStats) -> Iterator[Metric]:
    """The namespaces' indexes in shared memory, per tenant against tenants.max_index_memory
    (tenants bounded as for the pool's series, the rest as "other")."""
    held = GaugeMetricFamily("kvd_index_memory_bytes",
                             "Shared memory a tenant's namespaces' indexes hold.",
                             labels=["tenant"])
    limit = GaugeMetricFamily("kvd_index_memory_limit_bytes",
                              "A tenant's index memory limit (tenants.max_index_memory); 0: none.",
                              labels=["tenant"])
    refused = CounterMetricFamily("kvd_index_memory_refused",
                                  "Namespaces refused for a tenant's index memory limit.",
                                  labels=["tenant"])
    names = sorted(mem.tenants)
    groups = [(name, [mem.tenants[name]]) for name in names[:MAX_NAMESPACE_LABELS]]
    if names[MAX_NAMESPACE_LABELS:]:
        groups.append(("other", [mem.tenants[n] for n in names[MAX_NAMESPACE_LABELS:]]))
    for label, members in groups:
        held.add_metric([label], sum(t.bytes for t in members))
        limit.add_metric([label], sum(t.limit_bytes for t in members))
        refused.add_metric([label], sum(t.refused_total for t in members))
    yield from (held, limit, refused)
    yield _counter("kvd_namespaces_forgotten",
                   "Empty namespaces forgotten (their index closed) since start.",
                   mem.namespaces_forgotten_total)


# The retention series per tenant: (name, help, RetentionTenantStats field, counter?).
RETENTION_SERIES = (
    ("kvd_retention_blocks", "Blocks agent sessions' hints retain in the pool, by tenant.",
     "retained_blocks", False),
    ("kvd_retention_bytes", "Pool bytes of a tenant's retained blocks.", "retained_bytes",
     False),
    ("kvd_retention_quota_bytes", "What a tenant's retained blocks may occupy "
     "(retention.max_share of its pool share).", "quota_bytes", False),
    ("kvd_retention_sessions", "Agent sessions (tags) of a tenant with retained blocks.",
     "sessions", False),
    ("kvd_retention_retained_blocks", "Blocks that became retained.", "retained_blocks_total",
     True),
    ("kvd_retention_cut_blocks", "Blocks hints asked for past the tenant's quota (not "
     "retained).", "cut_blocks_total", True),
    ("kvd_retention_expired_blocks", "Retained blocks whose hint ran out.",
     "expired_blocks_total", True),
    ("kvd_retention_released_blocks", "Retained blocks let go by a release of their session.",
     "released_blocks_total", True),
    ("kvd_retention_gave_way_blocks", "Retained blocks evicted anyway: no other victim was "
     "left.", "gave_way_blocks_total", True),
    ("kvd_retention_prewarmed_blocks", "Blocks prewarms promoted into the pool.",
     "prewarmed_blocks_total", True),
    ("kvd_retention_prewarm_hits", "Prewarmed blocks an engine then loaded.",
     "prewarm_hits_total", True),
)


def _retention(r: RetentionStats) -> Iterator[Metric]:
    """Agent sessions' retention (docs/agents.md): hints taken and refused, and per tenant
    (bounded as for the pool's series, the rest as "other") what they retain."""
    yield _counter("kvd_retention_hints", "Requests' retention hints taken.", r.hints_total)
    yield _counter("kvd_retention_hints_refused", "Malformed retention hints refused (the "
                   "request went on without).", r.hints_refused_total)
    names = sorted(r.tenants)
    groups = [(name, [r.tenants[name]]) for name in names[:MAX_NAMESPACE_LABELS]]
    if names[MAX_NAMESPACE_LABELS:]:
        groups.append(("other", [r.tenants[n] for n in names[MAX_NAMESPACE_LABELS:]]))
    for name, doc, attr, counter in RETENTION_SERIES:
        cls = CounterMetricFamily if counter else GaugeMetricFamily
        fam = cls(name, doc, labels=["tenant"])
        for label, members in groups:
            fam.add_metric([label], float(sum(getattr(t, attr) for t in members)))
        yield fam


def _connections(connections: ConnectionStats) -> Iterator[Metric]:
    yield _gauge("kvd_connections", "Connections to the gRPC socket piped to the server now.",
                 connections.open)
    yield _counter("kvd_connections_refused", "Connections refused: their uid held "
                   "server.max_connections_per_uid already.", connections.refused_total)
    yield _counter("kvd_connections_idle_closed", "Connections closed after "
                   "server.idle_timeout without traffic (or sending nothing at all).",
                   connections.idle_closed_total)
    yield _counter("kvd_connections_shed", "Connections closed, the idlest first, at the "
                   "daemon's descriptor limit.", connections.shed_total)
    yield _counter("kvd_attach_refused", "Requests on the attach socket refused (not allowed, "
                   "draining, a limit, malformed).", connections.attach_refused_total)


_TIER_COUNTERS = (
    ("kvd_tier_demotions", "Blocks written to the tier (demoted from the pool).",
     "demotions_total"),
    ("kvd_tier_demoted_bytes", "Bytes written to the tier.", "demoted_bytes_total"),
    ("kvd_tier_promotions", "Blocks read back from the tier, checksum verified.",
     "promotions_total"),
    ("kvd_tier_promoted_bytes", "Bytes read back from the tier.", "promoted_bytes_total"),
    ("kvd_tier_hits", "Promotions that served a block.", "hits_total"),
    ("kvd_tier_misses", "Promotions of a key the tier did not hold.", "misses_total"),
    ("kvd_tier_demotions_refused", "Demotions refused (queue full, degraded, over quota, "
     "block larger than an extent): the block was lost instead.", "demotions_refused_total"),
    ("kvd_tier_evictions", "Blocks the tier dropped for room (LRU, tenant quota).",
     "evictions_total"),
    ("kvd_tier_store_full", "Puts a full store refused (the cluster tier): that block alone, "
     "the tier serves on.", "store_full_total"),
    ("kvd_tier_finds", "Keys engines asked the cluster store about (held nowhere on the node).",
     "finds_total"),
    ("kvd_tier_find_calls", "Batched existence calls those asks cost the store.",
     "find_calls_total"),
    ("kvd_tier_found", "Keys the store held when asked (named held below).", "found_total"),
    ("kvd_tier_corrupt_blocks", "Blocks that failed their checksum: dropped, never served.",
     "corrupt_total"),
    ("kvd_tier_io_failures", "Reads and writes that failed.", "failures_total"),
    ("kvd_tier_write_seconds", "Time the tier's I/O threads spent writing.",
     "write_seconds_total"),
    ("kvd_tier_read_seconds", "Time the tier's I/O threads spent reading (and verifying).",
     "read_seconds_total"),
    ("kvd_tier_promotions_refused", "Promotions not started: no pool slot free yet (engines "
     "ask again) or too many open.", "promotions_refused_total"),
    ("kvd_tier_promotions_late", "Promotions given up past their deadline (the key read "
     "MISS).", "promotions_late_total"),
)


def _tiers(tiers: list[TierStats]) -> Iterator[Metric]:
    """Each tier below the pool, labelled by its name (bounded: one per kind of tier)."""
    if not tiers:
        return
    up = GaugeMetricFamily("kvd_tier_up", "1 when the tier takes demotions (0: degraded: "
                           "a disk full, read-only or failing).", labels=["tier"])
    capacity = GaugeMetricFamily("kvd_tier_capacity_bytes", "Bytes the tier may hold.",
                                 labels=["tier"])
    used = GaugeMetricFamily("kvd_tier_used_bytes", "Bytes of blocks the tier holds.",
                             labels=["tier"])
    blocks = GaugeMetricFamily("kvd_tier_blocks", "Blocks the tier holds.", labels=["tier"])
    queue = GaugeMetricFamily("kvd_tier_queue_depth", "Demotions and promotions not finished.",
                              labels=["tier"])
    promoting = GaugeMetricFamily("kvd_tier_promotions_open", "Promotions into the pool "
                                  "not finished.", labels=["tier"])
    below = GaugeMetricFamily("kvd_tier_below_keys", "Keys named to engines as held by the "
                              "tier (their lookups answer HIT_PENDING).", labels=["tier"])
    counters = {name: CounterMetricFamily(name, doc, labels=["tier"])
                for name, doc, _ in _TIER_COUNTERS}
    for t in tiers:
        up.add_metric([t.name], 1.0 if t.health == "ok" else 0.0)
        capacity.add_metric([t.name], float(t.capacity_bytes))
        used.add_metric([t.name], float(t.used_bytes))
        blocks.add_metric([t.name], float(t.blocks))
        queue.add_metric([t.name], float(t.queue_depth))
        promoting.add_metric([t.name], float(t.promotions_open))
        below.add_metric([t.name], float(t.below_keys))
        for name, _, attr in _TIER_COUNTERS:
            counters[name].add_metric([t.name], float(getattr(t, attr)))
    yield from (up, capacity, used, blocks, queue, promoting, below, *counters.values())


def _restart(restart: RestartStats) -> Iterator[Metric]:
    yield _gauge("kvd_restart_warm", "1 when the cache is kept across a restart of the daemon "
                 "(restart.warm).", 1 if restart.enabled else 0)
    yield _gauge("kvd_restart_adopted_blocks", "Blocks this daemon adopted from its "
                 "predecessor at start (warm restart).", restart.blocks_adopted)
    yield _gauge("kvd_restart_adopted_timestamp_seconds", "When this daemon adopted its "
                 "predecessor's blocks (unix time; 0: it did not).", restart.adopted_at)
    dropped = CounterMetricFamily("kvd_restart_blocks_dropped", "Blocks a warm restart found "
                                  "inconsistent or could not hold, by reason: dropped, never "
                                  "served.", labels=["reason"])
    for reason, n in sorted(restart.blocks_dropped.items()):
        dropped.add_metric([reason], float(n))
    yield dropped
    yield _gauge("kvd_restart_held_sessions", "Engines of the previous daemon still holding "
                 "what they may copy (their slots wait).", restart.held_sessions)


class MetricsServer:
    """The /metrics HTTP endpoint (prometheus-client's threaded server, private registry)."""

    def __init__(self, registry: CollectorRegistry, address: str, port: int) -> None:
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr=address, registry=registry)
        self.port = self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def build_registry(snapshot: Callable[[], StatsSnapshot]
                   ) -> tuple[CollectorRegistry, RpcMetrics]:
    """A private registry with the stats collector, the request-path metrics and the standard
    process and Python series.

    prometheus_client adds a `*_created` sample (a start timestamp) to every counter and
    histogram unless told not to; Prometheus has no use for them here (counter resets are
    detected without), so the daemon, the only user of this process's metrics, turns them off.
    """
    disable_created_metrics()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(snapshot))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry, RpcMetrics(registry)


def start_metrics(registry: CollectorRegistry, address: str, port: int) -> MetricsServer:
    """Serve `registry` on http://address:port/metrics (port 0 picks a free port). The daemon's
    start-up summary logs the address, so this does not."""
    return MetricsServer(registry, address, port)


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], StatsSnapshot],
            timeout: float = 2.0) -> Callable[[], StatsSnapshot]:
    """Wrap `fn` so a scrape (on the HTTP thread) runs it on the daemon's event loop.

    The core is single-threaded; reading it from another thread could see it mid-update.
    """

    async def _call() -> StatsSnapshot:
        return fn()

    def snapshot() -> StatsSnapshot:
        return asyncio.run_coroutine_threadsafe(_call(), loop).result(timeout)

    return snapshot
