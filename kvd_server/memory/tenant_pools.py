"""One pool file per tenant, one memory budget for the node.

An engine maps the file of its own tenant only, so no descriptor it holds covers another
tenant's bytes: isolation is the kernel's, not just the index's. Every file is as large as the
pool and sparse; an extent's pages live in the file of the tenant that holds it. When an extent
changes tenant (ExtentAllocator.on_move), its pages move: punched out of the old file (whose
mappings then read zeros there) and populated in the new one, on a worker thread so the event
loop never waits for it. With one tenant (the default) there is one file, pre-faulted at start
as before, and nothing ever moves.

A tenant's engines could write into ranges of their file their tenant does not hold; the
daemon gives such pages back periodically (`trim`), so that costs the writer, briefly, and
never the node's budget for long.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from kvd_server.config import DEFAULT_TENANT, PoolConfig
from kvd_server.memory.pool import HostPool

log = logging.getLogger(__name__)


class WarmFiles(Protocol):
    """Where a warm restart keeps the tenants' pool files (kvd_server/restart/warm.py)."""

    backing: str            # "file" (a directory) or "memfd" (systemd's store)

    def pool(self, tenant: str, size: int) -> HostPool: ...


class TenantPools:
    """The pool files by tenant; `default` is created (and pre-faulted by the daemon) at start,
    the others on a tenant's first attach."""

    def __init__(self, config: PoolConfig, warm: WarmFiles | None = None) -> None:
        self.config = config
        self.warm = warm            # warm restart: the pool files live in its directory
        self._pools: dict[str, HostPool] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvd-pool")
        self.extent_bytes = 0       # set by the daemon once the extent size is known

    @property
    def backing(self) -> str:
        """memfd or file (a warm restart's pools are files)."""
        return self.warm.backing if self.warm is not None else self.config.backing

    @property
    def default(self) -> HostPool:
        return self.for_tenant(DEFAULT_TENANT)

    def for_tenant(self, tenant: str) -> HostPool:
        """The pool file of `tenant` (created on first use; PoolError when it cannot be)."""
        pool = self._pools.get(tenant)
        if pool is None:
            cfg = self.config
            name = "kvd-pool" if tenant == DEFAULT_TENANT else \
                "kvd-pool." + hashlib.sha256(tenant.encode()).hexdigest()[:16]
            if self.warm is not None:
                pool = self.warm.pool(tenant, cfg.size)
            else:
                pool = HostPool.create(cfg.size, cfg.backing, cfg.path, cfg.persist, name=name)
            self._pools[tenant] = pool
            if tenant != DEFAULT_TENANT:
                log.info("tenant %s has its own pool file now (%s)", tenant,
                         pool.path or "memfd")
        return pool

    def __iter__(self):  # noqa: ANN204 - an iterator of (tenant, pool)
        return iter(self._pools.items())

    def relocate(self, extent: int, old: str | None, new: str) -> None:
        """ExtentAllocator.on_move: extent `extent` now belongs to `new`; move its pages."""
        source = self._pools.get(old) if old is not None else None
        target = self.for_tenant(new)
        offset, length = extent * self.extent_bytes, self.extent_bytes
        cfg = self.config
        self._worker.submit(self._move, source, target, offset, length,
                            cfg.prefault or cfg.mlock, cfg.mlock)

    @staticmethod
    def _move(source: HostPool | None, target: HostPool, offset: int, length: int,
              populate: bool, lock: bool) -> None:
        if source is not None:
            source.release(offset, length, locked=lock)
        if populate:
            target.populate(offset, length, lock=lock)

    def trim(self, owners: Sequence[str | None]) -> None:
        """Give back pages a tenant's file holds in extents it does not hold (written there by
        one of its engines): on the worker thread, for files holding more than they own."""
        self._worker.submit(self._trim, dict(self._pools), list(owners), self.extent_bytes)

    @staticmethod
    def _trim(pools: dict[str, HostPool], owners: list[str | None], extent: int) -> None:
        for tenant, pool in pools.items():
            owned = sum(1 for o in owners if o == tenant) * extent
            if pool.closed or pool.resident_bytes() <= owned + extent:
                continue
            freed = 0
            for index, owner in enumerate(owners):
                if owner != tenant:
                    pool.release(index * extent, extent)
                    freed += 1
            log.warning("tenant %s's pool file held pages outside its extents (written by one "
                        "of its engines); gave back %d extents' worth of ranges", tenant, freed)

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
