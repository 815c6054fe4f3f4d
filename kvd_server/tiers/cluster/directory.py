"""Which blocks the cluster store holds, as far as this node knows: its own and the others'.

The store has no listing call: each node lists the blocks it published, per namespace, in a
manifest of its own (kvd_server/tiers/cluster/names.py) and reads the other nodes' manifests
of the namespaces its engines use, every sync interval. A block is known when this node
published it or another node's manifest names it; a promotion that finds it gone (the
store evicted it, its node left, the master restarted) forgets it (a MISS, never wrong
bytes: every block carries its checksum).

Thread-safe: the tier's threads and the daemon's event loop call it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from kvd_server.tiers.cluster.names import (
    NODES,
    StoreFormatError,
    decode_manifest,
    decode_nodes,
    encode_manifest,
    encode_nodes,
    manifest_name,
)
from kvd_server.tiers.cluster.store import Store, StoreError, replica_lost

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SyncResult:
    """What a sync learned: keys other nodes named for the first time, keys no longer named
    by anyone (each by namespace)."""

    found: dict[str, list[bytes]] = field(default_factory=dict)
    gone: dict[str, list[bytes]] = field(default_factory=dict)


class Directory:
    """This node's view of the store's blocks (see the module doc)."""

    def __init__(self, node: str, max_keys: int) -> None:
        self.node = node
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._own: dict[str, dict[bytes, None]] = {}      # published here, oldest first
        self._others: dict[str, dict[str, set[bytes]]] = {}   # ns -> node -> its manifest
        self._found: dict[str, set[bytes]] = {}           # union of the others'
        self._dirty: set[str] = set()                    # own manifests to write
        self._watched: set[str] = set()

    def watch(self, namespace: str) -> None:
        """Read the other nodes' manifests of this namespace from the next sync on."""
        with self._lock:
            self._watched.add(namespace)

    def known(self, namespace: str, key: bytes) -> bool:
        with self._lock:
            return key in self._own.get(namespace, ()) or key in self._found.get(namespace, ())

    def mine(self, namespace: str, key: bytes) -> bool:
        with self._lock:
            return key in self._own.get(namespace, ())

    def keys(self, namespace: str) -> list[bytes]:
        with self._lock:
            return list({**self._own.get(namespace, {}),
                         **dict.fromkeys(self._found.get(namespace, ()))})

    @property
    def count(self) -> int:
        with self._lock:
            return sum(map(len, self._own.values())) + sum(map(len, self._found.values()))

    def counts(self) -> dict[str, int]:
        """`count` by namespace (what the tier's used bytes are made of)."""
        with self._lock:
            out = {ns: len(keys) for ns, keys in self._own.items() if keys}
            for ns, found in self._found.items():
                if found:
                    out[ns] = out.get(ns, 0) + len(found)
            return out

    def published(self, namespace: str, key: bytes) -> list[bytes]:
        """This node published `key`; the own keys it no longer lists (past max_keys, the
        oldest: they stay in the store until it evicts them, named by no manifest)."""
        with self._lock:
            own = self._own.setdefault(namespace, {})
            own[key] = None
            self._dirty.add(namespace)
            dropped = []
            while len(own) > self.max_keys:
                oldest = next(iter(own))
                del own[oldest]
                dropped.append(oldest)
            return dropped

    def forget(self, namespace: str, key: bytes) -> None:
        """`key` is gone from the store (a promotion found it missing or corrupt)."""
        with self._lock:
            if self._own.get(namespace, {}).pop(key, 0) is None:
                self._dirty.add(namespace)
            self._found.get(namespace, set()).discard(key)

    def forget_namespace(self, namespace: str) -> None:
        with self._lock:
            if self._own.pop(namespace, None):
                self._dirty.add(namespace)
            self._found.pop(namespace, None)
            self._others.pop(namespace, None)

    def clear(self) -> dict[str, list[bytes]]:
        """Forget everything (the store may have lost it all: a master restarted); what was
        known, by namespace. The manifests are written again as blocks are published."""
        with self._lock:
            known = {ns: list(keys) for ns, keys in self._own.items()}
            for ns, keys in self._found.items():
                known.setdefault(ns, []).extend(keys)
            self._own.clear()
            self._others.clear()
            self._found.clear()
            self._dirty.clear()
            return known

    # --------------------------------------------------------------- syncing
    def sync(self, store: Store) -> SyncResult:
        """Register this node, write its changed manifests, read the others' (raises the
        store's errors: the caller degrades the tier; a write that failed for its object
        alone, `replica_lost`, is made again at the next sync)."""
        self._register(store)
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            writes = {ns: list(self._own.get(ns, {})) for ns in dirty}
            watched = set(self._watched)
        for ns, keys in writes.items():
            try:
                store.put(manifest_name(ns, self.node), encode_manifest(keys))
            except Exception as exc:
                lost = replica_lost(exc)        # this manifest's place only: the rest go on
                with self._lock:
                    self._dirty |= {ns} if lost else dirty      # written at a later sync
                if not lost:
                    raise
        nodes = [n for n in self._nodes(store) if n != self.node]
        result = SyncResult()
        for ns in watched:
            manifests: dict[str, set[bytes]] = {}
            for node in nodes:
                value = store.get(manifest_name(ns, node))
                if value is None:
                    continue
                try:
                    manifests[node] = set(decode_manifest(value)[:self.max_keys])
                except StoreFormatError as exc:
                    log.warning("cluster tier: node %s's manifest of %s is unreadable (%s): "
                                "ignored", node, ns[:12], exc)
            self._apply(ns, manifests, result)
        return result

    def _apply(self, ns: str, manifests: dict[str, set[bytes]], result: SyncResult) -> None:
        union: set[bytes] = set().union(*manifests.values()) if manifests else set()
        with self._lock:
            before = self._found.get(ns, set())
            own = self._own.get(ns, {})
            found = [k for k in union - before if k not in own]
            gone = [k for k in before - union if k not in own]
            self._others[ns] = manifests
            self._found[ns] = union
        if found:
            result.found[ns] = found
        if gone:
            result.gone[ns] = gone

    def _nodes(self, store: Store) -> list[str]:
        value = store.get(NODES)
        if value is None:
            return []
        try:
            return decode_nodes(value)
        except StoreFormatError as exc:
            log.warning("cluster tier: the store's node list is unreadable (%s): rewritten", exc)
            return []

    def _register(self, store: Store) -> None:
        """Name this node in the store's node list (read, add, write: two nodes joining at
        once may drop one of them, which names itself again at its next sync)."""
        nodes = self._nodes(store)
        if self.node not in nodes:
            try:
                store.put(NODES, encode_nodes([*nodes, self.node]))
            except StoreError as exc:
                if not replica_lost(exc):
                    raise                   # else: named at the next sync
