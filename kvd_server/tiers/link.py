"""A tier joined to the daemon: demotion down, promotion up, and the tables that tell engines
what is held below (kvd_server/tiers/demotion.py, promotion.py, below_table.py).

Every namespace the daemon has, and every one it makes later, gets the tier as its `below`
and a "held below" table; a namespace forgotten closes its table.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvd_proto.below_layout import FLAG_ASK
from kvd_server.tiers.base import Tier, TierHealth, TierKey, TierStats
from kvd_server.tiers.below_table import BelowTable, BelowTables
from kvd_server.tiers.demotion import Demoter
from kvd_server.tiers.promotion import Promoter
from kvd_server.units import format_duration

if TYPE_CHECKING:
    from kvd_server.config import Config
    from kvd_server.core.namespaces import Namespace, NamespaceTable
    from kvd_server.memory.tenant_pools import TenantPools

log = logging.getLogger(__name__)

NAMED_CHUNK = 2048        # keys named (or no longer) per event-loop callback


class TierLink:
    """One tier below the pool, joined to a daemon's namespaces (see the module doc)."""

    def __init__(self, tier: Tier, namespaces: NamespaceTable, pools: TenantPools,
                 loop: asyncio.AbstractEventLoop,
                 refusing: Callable[[], bool] = lambda: False) -> None:
        self.tier = tier
        self._loop = loop
        self.tables = BelowTables(tier)
        self._readable = False       # the first tick with the tier open names what it holds
        self.demoter = Demoter(tier, namespaces, pools, self.tables, loop)
        self.promoter = Promoter(tier, namespaces, pools, self.tables, loop, refusing)
        tier.on_named = self._named     # keys a tier shared with other nodes lost
        self._tenants: dict[str, str] = {}       # namespace id -> tenant (for find_flags)
        namespaces.on_made.append(self.join)
        namespaces.on_forgotten.append(self.forget)
        for ns in namespaces:
            self.join(ns)

    def _named(self, keys: list[TierKey], found: bool) -> None:
        """From the tier's threads: keys to name to the engines (found) or no longer, in
        chunks (a reconnected cluster tier forgets every key it knew at once: a million keys
        in one callback would hold the event loop, and every engine's step, for seconds)."""
        apply = self.tables.held if found else self.tables.lost
        with contextlib.suppress(RuntimeError):     # a closed loop: the daemon is stopping
            for start in range(0, len(keys), NAMED_CHUNK):
                self._loop.call_soon_threadsafe(apply, keys[start:start + NAMED_CHUNK])

    def join(self, ns: Namespace) -> None:
        # The size the cluster tier counts that namespace's blocks at.
        self.tier.join_namespace(ns.id, ns.tenant, ns.layout.block_bytes)
        self.demoter.join(ns)
        self.tables.join(ns.id, ns.layout.block_bytes).flags = self.tier.find_flags(ns.tenant)
        self._tenants[ns.id] = ns.tenant

    def forget(self, ns: Namespace) -> None:
        self.tables.forget(ns.id)
        self._tenants.pop(ns.id, None)

    def find(self, ns: Namespace, keys: Sequence[bytes], done: Callable[[], None]) -> bool:
        """Ask the tier (the cluster store) about keys an engine's lookups missed; `done` is
        called on the event loop once what it holds of them is named in the held-below
        table. False (done never called): the tier does not look for keys now, or not for
        this namespace's tenant (one that does not share: its engines are never told to ask,
        and one that asks anyway asks nothing)."""
        if not self.tier.find_flags(ns.tenant) & FLAG_ASK:
            return False
        future = self.tier.find(ns.id, keys)
        if future is None:
            return False

        def answered(f: Future[list[bytes]]) -> None:
            found = f.result() if not f.cancelled() and f.exception() is None else []
            with contextlib.suppress(RuntimeError):     # a closed loop: the daemon stops
                self._loop.call_soon_threadsafe(self._found, ns.id, found, done)

        future.add_done_callback(answered)
        return True

    def _found(self, ns_id: str, found: list[bytes], done: Callable[[], None]) -> None:
        if found:
            self.tables.held([TierKey(ns_id, k) for k in found])
        done()

    def promote(self, ns: Namespace, keys: Sequence[bytes], prefix: bool = False) -> set[bytes]:
        """Start promoting the keys of `ns` that only the tier below holds (`prefix`: up to
        the first key held nowhere); the keys being promoted (answered HIT_PENDING)."""
        if not keys:
            return set()
        return self.promoter.promote(ns, keys, prefix)

    def table(self, ns_id: str) -> BelowTable | None:
        """The namespace's "held below" table (its fd goes to engines: attach role below)."""
        return self.tables.get(ns_id)

    def tick(self) -> None:
        """The daemon's periodic sweep: once the tier is open (at start, its files open on
        its own thread) and whenever its reads work again, name what it holds; while they
        fail, name nothing (engines read MISS instead of waiting on doomed promotions)."""
        readable = self.tier.readable
        if readable != self._readable:
            self._readable = readable
            if readable:
                self.tables.fill_all()
            else:
                self.tables.clear_all()
        for ns_id, tenant in self._tenants.items():     # ask the store while it answers
            table = self.tables.get(ns_id)
            if table is not None:
                table.flags = self.tier.find_flags(tenant)

    @property
    def parts(self) -> tuple[Tier, ...]:
        """The tiers joined (two for a disk tier over the cluster store: tiers/stack.py)."""
        return self.tier.parts

    async def publish_health(self, health: Any) -> None:
        """Into the daemon's gRPC health servicer (`kvd health` reads it): each tier's own
        service, `kvd.tier.NAME`, NOT_SERVING while it is opening or degraded (the daemon's
        "" stays SERVING: the pool serves without it)."""
        from grpc_health.v1 import health_pb2

        for part in self.parts:
            ok = part.stats().health == TierHealth.OK
            await health.set(f"kvd.tier.{part.name}",
                             health_pb2.HealthCheckResponse.SERVING if ok
                             else health_pb2.HealthCheckResponse.NOT_SERVING)

    def stats(self) -> list[TierStats]:
        """Each tier's counters; the promotions and the held-below tables (one machinery for
        all of them) counted on the first."""
        out = [part.stats() for part in self.parts]
        out[0] = dataclasses.replace(
            out[0], promotions_open=self.promoter.open,
            promotions_refused_total=self.promoter.refused_total,
            promotions_late_total=self.promoter.late_total,
            below_keys=self.tables.keys_named)
        return out

    async def write_down_at_stop(self, cfg: Config) -> None:
        """A clean stop (the ways in closed): without warm restart the pool dies with the
        daemon, so its READY blocks are written down to the disk tier for at most
        `tiers.disk.flush_on_stop` (0: none), said in one line, and the next daemon finds
        them below. With warm restart the pool itself survives: nothing is written. Never
        raises: the stop goes on whatever happens here."""
        seconds = cfg.tiers_disk.flush_on_stop
        if not cfg.tiers_disk.path or cfg.restart.warm:
            return
        if seconds <= 0:
            log.info("disk tier: the pool's blocks are not written down at stop "
                     "(tiers.disk.flush_on_stop = 0): they are lost with the pool")
            return
        started = time.monotonic()
        log.info("disk tier: writing the pool's blocks down before the daemon stops (for at "
                 "most %s: tiers.disk.flush_on_stop)", format_duration(seconds))
        try:
            out = await self.demoter.write_down(seconds)
        except Exception:  # a bug must not stop the stop: the pool's blocks are lost
            log.exception("disk tier: writing the pool down at stop failed")
            return
        if not out.total:
            log.info("disk tier: the pool held no block to write down")
            return
        more = [f"{out.held} there already"] if out.held else []
        if out.failed:
            why = self.parts[0].stats().reason
            more.append(f"{out.failed} refused or failed" + (f": {why}" if why else ""))
        if out.finishing:
            more.append(f"{out.finishing} finishing as the tier closes")
        left = (f"; {out.left} left when the time ran out, lost with the pool (tiers.disk."
                f"flush_on_stop = {format_duration(seconds)})" if out.left else "")
        (log.warning if out.left or out.failed else log.info)(
            "disk tier: %d of the pool's %d blocks written at stop in %.1fs%s%s", out.written,
            out.total, time.monotonic() - started, f" ({'; '.join(more)})" if more else "",
            left)

    def close(self) -> None:
        self.tier.close()
        self.tables.close()


def start_tier(cfg: Config, namespaces: NamespaceTable, pools: TenantPools,
               loop: asyncio.AbstractEventLoop,
               refusing: Callable[[], bool] = lambda: False) -> TierLink | None:
    """The configured tiers below the pool ([tiers.disk], [tiers.cluster], or the disk over
    the cluster store), joined to the namespaces; None without one. A tier that cannot be
    used (a directory, a master) starts degraded (logged): the daemon serves."""
    disk = _disk_tier(cfg) if cfg.tiers_disk.path else None
    cluster = _cluster_tier(cfg) if cfg.tiers_cluster.master else None
    if disk is not None and cluster is not None:
        from kvd_server.tiers.stack import TierStack

        return TierLink(TierStack(disk, cluster), namespaces, pools, loop, refusing)
    tier = disk or cluster
    return None if tier is None else TierLink(tier, namespaces, pools, loop, refusing)


def _disk_tier(cfg: Config) -> Tier:
    from kvd_server.tiers.disk.tier import DiskTier

    disk = cfg.tiers_disk
    return DiskTier(disk.path, disk.size, extent_bytes=disk.extent_size,
                    io_threads=disk.io_threads, queue_bytes=disk.queue_size,
                    quota_of=disk.quota_of, open_now=False, retry_s=disk.retry_interval)


def node_name(cfg: Config) -> str:
    """This daemon's name in the cluster store: `tiers.cluster.node_id`, else the host's name
    and a digest of the daemon's socket path (two daemons of one host differ)."""
    if cfg.tiers_cluster.node_id:
        return cfg.tiers_cluster.node_id
    digest = zlib.crc32(os.path.abspath(cfg.server.socket).encode())
    return f"{socket.gethostname()}-{digest:08x}"


def _cluster_tier(cfg: Config) -> Tier:
    from kvd_server.tiers.cluster.store import StoreConfig
    from kvd_server.tiers.cluster.store_agent import AgentStore
    from kvd_server.tiers.cluster.tier import ClusterTier

    c = cfg.tiers_cluster
    store = StoreConfig(master=c.master, metadata_url=c.metadata_url, protocol=c.protocol,
                        device=c.device, local_hostname=c.local_hostname
                        or socket.gethostname(), segment_bytes=c.segment_size,
                        buffer_bytes=c.buffer_size)
    factory, threads = "kvd_server.tiers.cluster.store:open_mooncake", 2 * c.io_threads + 2
    return ClusterTier(lambda: AgentStore(factory, dataclasses.asdict(store), threads=threads),
                       node=node_name(cfg),
                       capacity_bytes=c.size, queue_bytes=c.queue_size,
                       io_threads=c.io_threads, sync_s=c.sync_interval,
                       retry_s=c.retry_interval, publish_stored=c.publish == "stored",
                       wait_lookups=c.lookup_wait, where=c.master, shares=c.shares)
