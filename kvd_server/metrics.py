"""Prometheus exposition for the daemon.

State metrics (pool, blocks, namespaces, sessions, counters) are read from `KvdCore.stats()` at
scrape time by a custom collector, so the hot path pays nothing for them. Only what cannot be
read back later is observed as it happens: RPC latencies, step-batch sizes and the transfer
sizes that clients report.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# RPC latency: a unary Python RPC costs ~0.4 ms, a stream message ~0.2 ms (DESIGN.md).
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
    """Turns the stats document (docs/internals.md) into metric families at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        # Unchecked registration: families depend on the live document.
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            doc = self._stats()
        except Exception:  # a scrape must never take the daemon down
            log.exception("stats snapshot failed during a scrape")
            yield GaugeMetricFamily("kvd_up", "1 when the daemon answered the scrape.", value=0)
            return
        yield GaugeMetricFamily("kvd_up", "1 when the daemon answered the scrape.", value=1)
        yield from _server(doc.get("server", {}))
        yield from _pool(doc.get("pool", {}))
        yield from _blocks(doc.get("blocks", {}))
        yield from _sessions(doc)
        yield from _totals(doc.get("stats", {}))
        yield from _namespaces(doc.get("namespaces", []))
        yield from _tenants(doc.get("tenants", {}))
        yield from _transfers(doc.get("transfers", {}))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=float(value))


def _server(server: dict[str, Any]) -> Iterator[Metric]:
    info = InfoMetricFamily("kvd_build", "kvd version and eviction policy.")
    info.add_metric([], {"version": str(server.get("version", "")),
                         "policy": str(server.get("policy", ""))})
    yield info
    state = GaugeMetricFamily("kvd_state", "1 for the daemon's current state.", labels=["state"])
    current = str(server.get("state", ""))
    for name in STATES:
        state.add_metric([name], 1.0 if name == current else 0.0)
    yield state
    yield _gauge("kvd_uptime_seconds", "Seconds since the daemon started.",
                 server.get("uptime_seconds", 0))


def _pool(pool: dict[str, Any]) -> Iterator[Metric]:
    yield _gauge("kvd_pool_total_bytes", "Size of the shared host pool.", pool.get("total_bytes", 0))
    yield _gauge("kvd_pool_used_bytes", "Pool bytes held by namespaces' extents.",
                 pool.get("used_bytes", 0))
    yield _gauge("kvd_pool_free_bytes", "Pool bytes in free extents.", pool.get("free_bytes", 0))
    yield _gauge("kvd_pool_extent_bytes", "Size of one extent (the unit a namespace grows by).",
                 pool.get("extent_bytes", 0))
    yield _gauge("kvd_pool_prefault_bytes", "Pool bytes pre-faulted so far (progress at start).",
                 pool.get("prefault_bytes_done", 0))
    yield _gauge("kvd_pool_mlocked", "1 when the pool is locked in RAM.",
                 1 if pool.get("mlocked") else 0)


def _blocks(blocks: dict[str, Any]) -> Iterator[Metric]:
    fam = GaugeMetricFamily("kvd_blocks", "Blocks in the pool by state.", labels=["state"])
    for state in ("storing", "ready", "pinned", "zombie"):
        fam.add_metric([state], float(blocks.get(state, 0)))
    yield fam


def _sessions(doc: dict[str, Any]) -> Iterator[Metric]:
    clients = doc.get("clients", {})
    yield _gauge("kvd_sessions", "Live engine sessions.", doc.get("sessions", 0))
    yield _counter("kvd_sessions_attached", "Sessions attached since start.",
                   clients.get("attached_total", 0))
    yield _counter("kvd_sessions_reaped", "Sessions ended by the liveness deadline.",
                   clients.get("reaped_total", 0))
    yield _counter("kvd_sessions_closed", "Sessions ended by their client or a closed stream.",
                   clients.get("closed_total", 0))


def _totals(stats: dict[str, Any]) -> Iterator[Metric]:
    yield _gauge("kvd_pins", "Pins held by loads in flight.", stats.get("pins", 0))
    yield _gauge("kvd_leases", "Lookup leases held.", stats.get("leases", 0))
    yield _counter("kvd_leases_expired", "Leases that expired before a load used them.",
                   stats.get("leases_expired_total", 0))
    yield _counter("kvd_resets", "Cache resets (engine or admin).", stats.get("resets_total", 0))
    yield _counter("kvd_step_calls", "Batched Step calls served.", stats.get("step_calls_total", 0))
    yield _counter("kvd_step_ops", "Operations carried by Step calls.",
                   stats.get("step_ops_total", 0))


_NS_COUNTERS = (
    ("kvd_lookups", "Keys looked up.", "lookups_total"),
    ("kvd_hits", "Lookups that found a readable block.", "hits_total"),
    ("kvd_misses", "Lookups that found nothing readable.", "misses_total"),
    ("kvd_evictions", "Blocks evicted to make room.", "evictions_total"),
    ("kvd_store_rejections", "prepare_store calls answered 'cannot store'.",
     "store_rejections_total"),
)


def _namespaces(namespaces: Sequence[dict[str, Any]]) -> Iterator[Metric]:
    rows = _bounded(namespaces)
    counters = {name: CounterMetricFamily(name, doc, labels=["namespace"])
                for name, doc, _ in _NS_COUNTERS}
    stores = CounterMetricFamily("kvd_stores", "Block stores by outcome.",
                                 labels=["namespace", "outcome"])
    slots = GaugeMetricFamily("kvd_namespace_slots", "Slots a namespace can hold now.",
                              labels=["namespace"])
    ns_blocks = GaugeMetricFamily("kvd_namespace_blocks", "Blocks of a namespace by state.",
                                  labels=["namespace", "state"])
    for label, ns in rows:
        for name, _, key in _NS_COUNTERS:
            counters[name].add_metric([label], float(ns.get(key, 0)))
        for outcome, key in (("started", "stores_started_total"),
                             ("completed", "stores_completed_total"),
                             ("failed", "stores_failed_total")):
            stores.add_metric([label, outcome], float(ns.get(key, 0)))
        slots.add_metric([label], float(ns.get("slots_capacity", 0)))
        for state, count in ns.get("blocks", {}).items():
            ns_blocks.add_metric([label, state], float(count))
    yield from counters.values()
    yield stores
    yield slots
    yield ns_blocks


def _tenants(tenants: dict[str, dict[str, Any]]) -> Iterator[Metric]:
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
        used.add_metric([name], tenants[name].get("used_bytes", 0))
        quota.add_metric([name], tenants[name].get("quota_bytes", 0))
    rest = names[MAX_NAMESPACE_LABELS:]
    if rest:
        used.add_metric(["other"], sum(tenants[n].get("used_bytes", 0) for n in rest))
        quota.add_metric(["other"], sum(tenants[n].get("quota_bytes", 0) for n in rest))
    yield used
    yield quota


def _bounded(namespaces: Sequence[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Namespaces as (label, values); past MAX_NAMESPACE_LABELS they add up under "other"."""
    rows = [(str(ns.get("id", "")), ns) for ns in namespaces[:MAX_NAMESPACE_LABELS]]
    rest = namespaces[MAX_NAMESPACE_LABELS:]
    if rest:
        other: dict[str, Any] = {"blocks": {}}
        for ns in rest:
            for key, value in ns.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    other[key] = other.get(key, 0) + value
            for state, count in ns.get("blocks", {}).items():
                other["blocks"][state] = other["blocks"].get(state, 0) + count
        rows.append(("other", other))
    return rows


def _transfers(transfers: dict[str, Any]) -> Iterator[Metric]:
    yield _counter("kvd_loaded_bytes",
                   "Bytes of blocks whose loads completed (block size x completed loads).",
                   transfers.get("completed_load_bytes_total", 0))
    yield _counter("kvd_stored_bytes",
                   "Bytes of blocks whose stores completed (block size x completed stores).",
                   transfers.get("completed_store_bytes_total", 0))
    yield _counter("kvd_transfer_load_bytes", "Bytes loaded pool->engine (client reports).",
                   transfers.get("load_bytes_total", 0))
    yield _counter("kvd_transfer_store_bytes", "Bytes stored engine->pool (client reports).",
                   transfers.get("store_bytes_total", 0))
    yield _counter("kvd_transfer_load_seconds", "Seconds spent loading (client reports).",
                   transfers.get("load_seconds_total", 0.0))
    yield _counter("kvd_transfer_store_seconds", "Seconds spent storing (client reports).",
                   transfers.get("store_seconds_total", 0.0))


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


def build_registry(stats: Callable[[], dict[str, Any]]) -> tuple[CollectorRegistry, RpcMetrics]:
    """A private registry with the stats collector and the request-path metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    return registry, RpcMetrics(registry)


def start_metrics(registry: CollectorRegistry, address: str, port: int) -> MetricsServer:
    """Serve `registry` on http://address:port/metrics (port 0 picks a free port)."""
    server = MetricsServer(registry, address, port)
    log.info("metrics on http://%s:%d/metrics", address, server.port)
    return server


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], dict[str, Any]],
            timeout: float = 2.0) -> Callable[[], dict[str, Any]]:
    """Wrap `fn` so a scrape (on the HTTP thread) runs it on the daemon's event loop.

    The core is single-threaded; reading it from another thread could see it mid-update.
    """

    async def _call() -> dict[str, Any]:
        return fn()

    def snapshot() -> dict[str, Any]:
        return asyncio.run_coroutine_threadsafe(_call(), loop).result(timeout)

    return snapshot
