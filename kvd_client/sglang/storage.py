"""kvd as SGLang's HiCache storage backend: SGLang 0.5.23 loads it by module path, no patch.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvd",
        "module_path": "kvd_client.sglang", "class_name": "KvdHiCacheStorage",
        "interface_v1": 1}'

(docs/sglang.md has the rest.) SGLang constructs the backend with its `HiCacheStorageConfig`,
then hands it the host KV pool (`register_mem_pool_host`): only then are the page's bytes
known, so that is where the session with the daemon starts (kvd_client/sglang/pager.py drives
it; kvd_client/sglang/identity.py names the namespace; kvd_client/sglang/pages.py copies).

Every call answers, whatever the daemon does: `batch_exists` from the mapped shared index
(no call to the daemon), the v1 calls a list of booleans (never None, which would stop
SGLang's prefetch or backup thread), and no exception reaches SGLang's threads (a failure is
counted, logged at most every 10 s, and answered as a miss or a store not made).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvd_client.client import KvdClient
from kvd_client.offload.session import OffloadSession
from kvd_client.sglang.identity import namespace_of
from kvd_client.sglang.keys import page_keys
from kvd_client.sglang.options import parse
from kvd_client.sglang.pager import HIT, MISS, PENDING, PageStore
from kvd_client.sglang.pages import LayoutError, PageGeometry

log = logging.getLogger(__name__)

KV_POOL = "kv"          # PoolName.KV: the one pool this backend stores


def _position(extra_info: HiCacheStorageExtraInfo | None) -> int:
    """The page index of a call's first key in its sequence (its prefix's length)."""
    prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
    return len(prefix) if isinstance(prefix, list) else 0


class KvdHiCacheStorage(HiCacheStorage):
    """SGLang's storage backend over a node's kvd daemon (see the module doc)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.options = parse(storage_config.extra_config)
        self.enable_metrics = bool(storage_config.enable_storage_metrics)
        self._store: PageStore | None = None
        self._geometry: PageGeometry | None = None
        self._extra_pools: list[str] = []
        self._registered = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------ host pools
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The host KV pool: its page geometry and the namespace follow from it, and the
        session with the daemon starts (degraded, reconnecting by itself, if it is away)."""
        super().register_mem_pool_host(mem_pool_host)
        geometry = PageGeometry.probe(mem_pool_host, self.options.copy_threads)
        dtype = str(getattr(mem_pool_host, "dtype", "")).removeprefix("torch.")
        ns = namespace_of(self.storage_config, page_size=geometry.page_size,
                          page_bytes=geometry.page_bytes,
                          pool_layout=str(getattr(mem_pool_host, "layout", "?")), dtype=dtype,
                          model=self.options.model, scope=self.options.namespace)
        import sglang

        config = self.storage_config
        client = KvdClient(
            self.options.socket_path, model=ns.model, layout=ns.layout, salt=ns.salt,
            engine_id=f"sglang:{socket.gethostname()}:{os.getpid()}:tp{config.tp_rank}"
                      f":pp{config.pp_rank}:dp{config.dp_rank}",
            engine_kind="sglang", engine_version=getattr(sglang, "__version__", ""),
            deadline_s=self.options.deadline_s)
        session = OffloadSession(client, reserve=self.options.reserve,
                                 keep_evicted=self.options.keep_evicted,
                                 answers=(MISS, HIT, PENDING))
        with self._lock:
            old, self._store = self._store, PageStore(client, session,
                                                      page_bytes=geometry.page_bytes)
            self._geometry = geometry
        if old is not None:
            old.close()
        log.info("kvd: SGLang rank %d stores pages of %d bytes in namespace %s of model %s "
                 "via %s", config.tp_rank, geometry.page_bytes, ns.salt, ns.model,
                 self.options.socket_path)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Hybrid models' extra pools (mamba, SWA, indexer, ...) need `batch_*_v2`, which kvd
        does not serve: refused when the pools are all registered (or at once, later)."""
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name == KV_POOL:
            return
        self._extra_pools.append(name)
        if self._registered:
            raise ValueError(self._hybrid_refusal())

    def on_host_pools_registered(self) -> None:
        self._registered = True
        if self._extra_pools:
            raise ValueError(self._hybrid_refusal())

    def _hybrid_refusal(self) -> str:
        return (f"kvd's SGLang backend stores the KV pool only; this model also has the "
                f"host pools {', '.join(self._extra_pools)} (a hybrid model), which need "
                "batch_*_v2: run it with another storage backend or without one")

    # ------------------------------------------------------------- zero copy
    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        store = self._store
        if store is None or not keys:
            return 0
        try:
            return store.exists(page_keys(keys))
        except Exception:  # noqa: BLE001 - never into SGLang's threads: counted, logged by PageStore.failed
            store.failed("an existence query")
            return 0

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        out = [False] * len(keys)
        store, geometry = self._store, self._geometry
        if store is None or geometry is None or not keys:
            return out
        try:
            firsts = geometry.firsts(host_indices, len(keys))
            got = store.load(page_keys(keys),
                             lambda base, offsets: geometry.load(firsts[:len(offsets)], base,
                                                                 offsets),
                             _position(extra_info))
            out[:got] = [True] * got
        except Exception:  # noqa: BLE001 - never into SGLang's threads: counted, logged by PageStore.failed
            store.failed("batch_get_v1")
        return out

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        store, geometry = self._store, self._geometry
        if store is None or geometry is None or not keys:
            return [False] * len(keys) if keys else []
        held = 0
        try:
            firsts = geometry.firsts(host_indices, len(keys))
            held = store.store(page_keys(keys),
                               lambda base, offsets, idx: geometry.store(firsts[idx], base,
                                                                         offsets),
                               _position(extra_info))
        except Exception:  # noqa: BLE001 - never into SGLang's threads: counted, logged by PageStore.failed
            store.failed("batch_set_v1")
        return [True] * held + [False] * (len(keys) - held)

    # ---------------------------------------------- flat pages (no interface_v1)
    def _flat(self, tensor: Any) -> int:
        """The address of a flat page tensor's bytes (it must be one contiguous page)."""
        store = self._store
        assert store is not None
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or \
                not tensor.is_contiguous() or \
                tensor.numel() * tensor.element_size() != store.page_bytes:
            raise ValueError(f"a page must be a contiguous CPU tensor of {store.page_bytes} "
                             "bytes")
        return int(tensor.data_ptr())

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        store, geometry = self._store, self._geometry
        out: list[torch.Tensor | None] = [None] * len(keys)
        if store is None or geometry is None or not keys:
            return out
        try:
            targets = list(target_locations) if target_locations is not None else \
                [torch.empty(store.page_bytes, dtype=torch.uint8) for _ in keys]
            addresses = [self._flat(t) for t in targets]

            def copy(base: int, offsets: Sequence[int]) -> int:
                return geometry.copy_flat([base + offset for offset in offsets],
                                          addresses[:len(offsets)])

            got = store.load(page_keys(keys), copy)
            out[:got] = targets[:got]
        except Exception:  # noqa: BLE001 - never into SGLang's threads: counted, logged by PageStore.failed
            store.failed("batch_get")
        return out

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        targets = None if target_location is None else [target_location]
        return self.batch_get([key], targets)[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        store, geometry = self._store, self._geometry
        if store is None or geometry is None or not keys or values is None:
            return False
        try:
            addresses = [self._flat(v) for v in values]
            if len(addresses) != len(keys):
                raise ValueError(f"{len(keys)} keys, {len(addresses)} pages")

            def copy(base: int, offsets: Sequence[int], idx: list[int]) -> int:
                return geometry.copy_flat([addresses[i] for i in idx],
                                          [base + offset for offset in offsets])

            return store.store(page_keys(keys), copy) == len(keys)
        except Exception:  # noqa: BLE001 - never into SGLang's threads: counted, logged by PageStore.failed
            store.failed("batch_set")
            return False

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ----------------------------------------------------------------- admin
    def clear(self) -> None:
        """SGLang's "clear the storage backend": drop every page of this namespace in the
        node's pool (every instance sharing it loses them, as a vLLM reset_cache does)."""
        store = self._store
        if store is not None:
            store.reset()

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics since the last call: pages per read and write call and
        their bandwidth (GB/s), as its other backends report them."""
        store = self._store
        if store is None:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        counters = store.counters
        loads, stores = counters.loads, counters.stores
        counters.loads, counters.stores = [], []
        metrics = StorageMetrics()
        gb = store.page_bytes / 1e9
        metrics.prefetch_pgs.extend(p for p, _ in loads)
        metrics.prefetch_bandwidth.extend(p * gb / max(s, 1e-9) for p, s in loads)
        metrics.backup_pgs.extend(p for p, _ in stores)
        metrics.backup_bandwidth.extend(p * gb / max(s, 1e-9) for p, s in stores)
        return metrics

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()


__all__ = ["KvdHiCacheStorage", "LayoutError"]
