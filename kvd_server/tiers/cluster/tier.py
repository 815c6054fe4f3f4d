"""The cluster tier: blocks shared between nodes through a Mooncake store.

Every block a namespace stores (`publish = "stored"`, the default) or evicts (`"evicted"`) is
copied at once and put into the store on the tier's own threads (write-behind, bounded by
`queue_bytes`: past it publications are refused and counted, the pool never waits). A block's
name is its namespace (tenant, model and layout: two tenants never share a block) and key, so
the store is its own directory: an engine's lookup that neither the pool's index nor the
namespace's "held below" table answers is reported with the engine's step (a FIND record),
and `find` asks the store about all of a step's keys in one batched existence call, at most
one call in flight per namespace (kvd_server/tiers/cluster/directory.py remembers what it
learned, and what was absent, briefly). A key the store holds is named in the held-below
table: the engine's next lookup answers HIT_PENDING and the daemon promotes it (the tier gets
it into the pool slot, checksum verified; a block gone or corrupt is a MISS, never served).
Nodes never read each other's lists: a node's directory traffic follows its engines' misses,
not the number of nodes.

The store's client blocks while its master is down (~4 s per call before it gives up), so
every call runs on the tier's threads: publications, promotions and finds apart (none waits
behind another), and a housekeeping thread that connects and checks the store every
`sync_s`. A failed call degrades the tier (one WARNING, counted, `kvd health` says so): it
refuses work for `retry_s`, then checks the store again; on recovery it forgets what it knew
(a restarted master has lost it) and finds it again as engines ask. A put a full store
refuses, or one whose replica's node died, costs that block alone: counted
(`store_full_total`, `failures_total`), logged once per interval, never a degradation, so the
client and its segment (and the blocks it holds for every node) go on.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvd_proto.below_layout import FLAG_ASK, FLAG_WAIT
from kvd_proto.ratelog import RateLimitedLog
from kvd_server.tiers.base import HELD_ALREADY, Tier, TierHealth, TierKey, TierStats
from kvd_server.tiers.cluster.directory import Directory
from kvd_server.tiers.cluster.names import (
    BLOCK_HEADER,
    StoreFormatError,
    block_name,
    check_block,
    encode_block,
    namespace_prefix,
)
from kvd_server.tiers.cluster.store import Store, StoreError, replica_lost, store_full

log = logging.getLogger(__name__)

RETRY_S = 10.0
SYNC_S = 1.0
MAX_REASON = 1000       # characters of a degraded reason (the store agent's are ~600 at most)
CLOSE_WAIT_S = 5.0      # the daemon's stop waits this long for the client to leave the store
PROBE = "kvd/v1/probe"  # a name asked about every sync_s: the store's health
MAX_FIND_KEYS = 4096    # keys waiting to be asked about, per namespace (past it: not asked)


@dataclass(slots=True)
class _Finding:
    """A namespace's keys waiting to be asked about, and the answer their askers wait for
    (one Future for all the asks of a round); there while its rounds run."""

    keys: dict[bytes, None] = field(default_factory=dict)
    answer: Future[list[bytes]] | None = None


class ClusterTier(Tier):
    """One daemon's view of the cluster store (see the module doc)."""

    name = "cluster"

    def __init__(self, connect: Callable[[], Store], *, node: str, capacity_bytes: int,
                 block_bytes_hint: int = 64 << 10, queue_bytes: int = 256 << 20,
                 io_threads: int = 4, sync_s: float = SYNC_S, retry_s: float = RETRY_S,
                 publish_stored: bool = True, wait_lookups: bool = True, where: str = "",
                 shares: Callable[[str], bool] = lambda tenant: True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`connect` makes the store's client (on the tier's thread: it may block for
        seconds); `capacity_bytes` bounds how many blocks the tier names (at
        `block_bytes_hint` each); `publish_stored`: every block as it is stored (the
        demoter hands them over), else only the blocks the pool evicts; `wait_lookups`:
        engines' lookups of keys being asked about answer "not known yet" until the answer
        (else MISS at once, `tiers.cluster.lookup_wait`); `shares(tenant)`: whether a
        tenant's namespaces use the store (`tiers.cluster.tenants`)."""
        self.publishes_stored = publish_stored
        self.wait_lookups = wait_lookups
        self.shares = shares
        self._connect = connect
        self._store: Store | None = None
        self.queue_bytes = queue_bytes
        self.sync_s = sync_s
        self.retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self.directory = Directory(node, max(1, capacity_bytes // max(1, block_bytes_hint)))
        self._stats = TierStats(self.name, health=TierHealth.OPENING,
                                capacity_bytes=capacity_bytes, directory=where)
        self.on_dropped: Callable[[list[TierKey]], None] | None = None
        # Keys named or no longer named because of other nodes (True: found), for the
        # engines' tables; set by the daemon.
        self.on_named: Callable[[list[TierKey], bool], None] | None = None
        self._in_flight = 0
        self._pending: set[TierKey] = set()
        # Each namespace's block size (one layout, so one size, on every node): told when it
        # joins, else learned from a block put or got. Used bytes are blocks x this.
        self._block_bytes: dict[str, int] = {}
        self._retry_at = 0.0
        self._puts = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="kvd-cluster-put")
        self._gets = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="kvd-cluster-get")
        self._finds = ThreadPoolExecutor(2, thread_name_prefix="kvd-cluster-find")
        self._finding: dict[str, _Finding] = {}
        self._closed = threading.Event()
        self._full_log = RateLimitedLog(log)      # a full store refuses many puts in a row
        self._keeper = threading.Thread(target=self._keep, name="kvd-cluster", daemon=True)
        self._keeper.start()

    # ----------------------------------------------------------------- health
    def _degrade(self, reason: str) -> None:
        if len(reason) > MAX_REASON:                  # bounded: `kvd stats` shows it whole
            reason = reason[:MAX_REASON - 3] + "..."
        with self._lock:
            st = self._stats
            if st.health is not TierHealth.DEGRADED or st.reason != reason:
                log.warning("cluster tier degraded (%s): publications and promotions refused "
                            "for %.0fs; the pool carries on without it", reason, self.retry_s)
            st.health, st.reason = TierHealth.DEGRADED, reason
            self._retry_at = self._clock() + self.retry_s

    def _failed(self, exc: Exception) -> None:
        """A call failed: counted; the tier degrades unless it failed for its object alone
        (`replica_lost`: a node died holding that object's place; `store_full`: a put the
        store had no room for: the store evicts by itself, and the client and its segment,
        with the blocks it holds, go on)."""
        if store_full(exc):
            with self._lock:
                self._stats.store_full_total += 1
            self._full_log.warning("cluster tier: the store is full: a publication is refused "
                                   "(that block alone; counted in store_full_total)")
            return
        with self._lock:
            self._stats.failures_total += 1
        if not replica_lost(exc):
            self._degrade(f"store: {exc}")

    @property
    def readable(self) -> bool:
        return self._store is not None and self._stats.health is TierHealth.OK

    def _usable(self) -> bool:
        return self.readable and not self._closed.is_set()

    # ---------------------------------------------------------------- queries
    def contains(self, key: TierKey) -> bool:
        return self.directory.known(key.namespace, key.key)

    def join_namespace(self, namespace: str, tenant: str, block_bytes: int = 0) -> None:
        """A namespace of this daemon: its blocks are counted at `block_bytes` each."""
        if block_bytes > 0:
            with self._lock:
                self._block_bytes[namespace] = block_bytes

    def find_flags(self, tenant: str) -> int:
        """Engines of a tenant that shares through the store report the keys held nowhere on
        this node (and wait a step for the answer, unless `wait_lookups` is off), while the
        store can be read."""
        if not self.shares(tenant) or not self._usable():
            return 0
        return FLAG_ASK | (FLAG_WAIT if self.wait_lookups else 0)

    # ------------------------------------------------------------------ finds
    def find(self, namespace: str, keys: Sequence[bytes]) -> Future[list[bytes]] | None:
        """Ask the store whether it holds `keys` (an engine's step's misses): the Future
        holds the ones it does. Keys of a namespace asked while a call for it runs wait for
        the next call (one call at a time per namespace, so at most one per engine step)."""
        if not self._usable():
            return None
        with self._lock:
            running = namespace in self._finding
            finding = self._finding.setdefault(namespace, _Finding())
            room = MAX_FIND_KEYS - len(finding.keys)
            finding.keys.update(dict.fromkeys(keys[:max(0, room)]))
            if finding.answer is None:
                finding.answer = Future()
            future = finding.answer
            self._stats.finds_total += len(keys)
            if running:
                return future
        try:
            self._finds.submit(self._find_rounds, namespace)
        except RuntimeError:                    # closed meanwhile
            with self._lock:
                self._finding.pop(namespace, None)
            future.set_result([])
        return future

    def _find_rounds(self, namespace: str) -> None:
        """On a find thread: ask about what waits for the namespace until nothing does."""
        while True:
            with self._lock:
                finding = self._finding[namespace]
                keys, answer = list(finding.keys), finding.answer
                finding.keys, finding.answer = {}, None
                if answer is None:
                    del self._finding[namespace]
                    return
            found: list[bytes] = []
            try:
                found = self._ask(namespace, keys)
            finally:
                answer.set_result(found)

    def _ask(self, namespace: str, keys: list[bytes]) -> list[bytes]:
        """One batched existence call for the keys not known here nor found absent lately;
        the ones the store holds (known from now on), with the ones known already (an
        engine asks about a known key when its held-below entry went: a promotion given up,
        the tables cleared while the store was down; named again, at no cost)."""
        known, ask = self.directory.split(namespace, keys)
        store = self._store
        if not ask or store is None or not self._usable():
            return known
        t0 = time.perf_counter()
        try:
            held = store.exists([block_name(namespace, k) for k in ask])
        except Exception as exc:  # noqa: BLE001 - any failure of the store is the tier's
            self._failed(exc)
            return known
        found = self.directory.answered(namespace, ask, held)
        with self._lock:
            st = self._stats
            st.find_calls_total += 1
            st.found_total += len(found)
            st.read_seconds_total += time.perf_counter() - t0
        return known + found

    def keys(self, namespace: str) -> list[bytes]:
        return self.directory.keys(namespace) if self.readable else []

    # ------------------------------------------------------------ publication
    def demote(self, key: TierKey, data: memoryview | bytes) -> Future[bool] | None:
        """Publish a block (stored or evicted): copied now, put on the tier's threads. A block
        the store holds already (this node's or another's, a promoted one) is not put again."""
        if self.contains(key):
            return HELD_ALREADY
        if not self.shares(key.tenant):
            return None                 # the tenant's blocks never leave the node
        length = len(data) + BLOCK_HEADER.size
        with self._lock:
            st = self._stats
            if key in self._pending:
                return None                                 # being put already
            if not self._usable() or self._in_flight + length > self.queue_bytes:
                st.demotions_refused_total += 1
                return None
            self._in_flight += length
            self._pending.add(key)
            st.queue_depth += 1
        block = bytes(data)     # the copy: the slot may be reused from now on
        return self._puts.submit(self._put, key, block)

    publish = demote        # what the demoter hands over as blocks are stored

    def _put(self, key: TierKey, block: bytes) -> bool:
        """On a put thread: checksum, header and the store's put (off the event loop)."""
        t0 = time.perf_counter()
        store, error = self._store, None
        value = encode_block(block)
        del block
        try:
            if store is None:
                raise StoreError("not connected")
            store.put(block_name(key.namespace, key.key), value)
        except Exception as exc:  # noqa: BLE001 - any failure of the store is the tier's
            error = exc
        with self._lock:
            st = self._stats
            self._in_flight -= len(value)
            self._pending.discard(key)
            st.queue_depth -= 1
            st.write_seconds_total += time.perf_counter() - t0
            if error is None:
                st.demotions_total += 1
                st.demoted_bytes_total += len(value) - BLOCK_HEADER.size
                self._block_bytes.setdefault(key.namespace, len(value) - BLOCK_HEADER.size)
        if error is not None:
            self._failed(error)
            return False
        self.directory.published(key.namespace, key.key)
        return True

    # -------------------------------------------------------------- promotion
    def promote(self, key: TierKey, dest: memoryview) -> Future[bool] | None:
        known = self.contains(key)
        with self._lock:       # readable and counted at once: see _tend's reconnection
            if not known or not self.readable:
                self._stats.misses_total += 1
                return None
            self._stats.queue_depth += 1
        return self._gets.submit(self._get, key, dest)

    def _get(self, key: TierKey, dest: memoryview) -> bool:
        t0 = time.perf_counter()
        store, good, error, corrupt = self._store, False, None, False
        try:
            if store is None:
                raise StoreError("not connected")
            value = store.get(block_name(key.namespace, key.key))
            if value is not None:
                data = check_block(value)
                if len(data) > len(dest):
                    raise StoreFormatError(f"a block of {len(data)} bytes for a "
                                           f"{len(dest)}-byte slot")
                dest[:len(data)] = data
                good = True
        except StoreFormatError as exc:
            corrupt = True
            log.warning("cluster tier: a block of %s failed its check (%s): dropped, not "
                        "served", key.namespace[:12], exc)
        except Exception as exc:  # noqa: BLE001
            error = exc
        with self._lock:
            st = self._stats
            st.queue_depth -= 1
            st.read_seconds_total += time.perf_counter() - t0
            if good:
                st.hits_total += 1
                st.promotions_total += 1
                st.promoted_bytes_total += len(data)
                self._block_bytes.setdefault(key.namespace, len(data))
            elif corrupt:
                st.corrupt_total += 1
            elif error is None:
                st.misses_total += 1             # gone from the store (evicted, node left)
        if error is not None:
            self._failed(error)
        elif not good:
            self._lost([key])
        return good

    def _lost(self, keys: list[TierKey]) -> None:
        """Blocks the store no longer holds: forgotten, and told (own ones as dropped, so
        their removed events go out; others' only leave the engines' tables)."""
        mine = [k for k in keys if self.directory.mine(k.namespace, k.key)]
        for k in keys:
            self.directory.forget(k.namespace, k.key)
        others = [k for k in keys if k not in mine]
        if mine and self.on_dropped is not None:
            self.on_dropped(mine)
        if others and self.on_named is not None:
            self.on_named(others, False)

    # ---------------------------------------------------------------- removal
    def remove(self, key: TierKey) -> bool:
        """Forget `key` here (the store keeps it for the other nodes; it evicts by itself)."""
        known = self.contains(key)
        self.directory.forget(key.namespace, key.key)
        return known

    def remove_namespace(self, namespace: str) -> int:
        """A reset: the namespace's blocks are dropped from the store (every node: the same
        tenant, model and layout), on the tier's thread."""
        n = len(self.directory.keys(namespace))
        self.directory.forget_namespace(namespace)
        with self._lock:
            if not self._usable():
                return n        # the store is down: a restarted master has lost them anyway
            self._stats.queue_depth += 1
        self._puts.submit(self._remove_namespace, namespace)
        return n

    def _remove_namespace(self, namespace: str) -> None:
        store, error = self._store, None
        try:
            if store is not None:
                store.remove_prefix(namespace_prefix(namespace))
        except Exception as exc:  # noqa: BLE001
            error = exc
        with self._lock:
            self._stats.queue_depth -= 1
        if error is not None:
            self._failed(error)

    # ------------------------------------------------------------ housekeeping
    def _keep(self) -> None:
        """Connect, check the store every sync_s (a degraded one again every retry_s)."""
        while not self._closed.is_set():
            try:
                self._tend()
            except Exception:  # the thread must go on (logged)
                log.exception("cluster tier: housekeeping failed")
            self._closed.wait(self.sync_s)

    def _tend(self) -> None:
        """One round of the housekeeping thread. A degraded tier, once retry_s passed and its
        calls in flight ended, checks its client: one that answers again over a store that
        still holds this node's blocks (a network blip, a master slow for a while) serves
        on, its segment and what the tier knew kept. Otherwise (its agent died, or the
        master restarted: it knows neither this node's segment nor any block) the client is
        dropped and a new one connects and mounts its segment again; what the tier knew is
        forgotten."""
        st = self._stats
        if st.health is TierHealth.DEGRADED:
            if self._clock() < self._retry_at:
                return
            with self._lock:
                if st.queue_depth:
                    return               # calls still run on the old client: wait for them
                old = self._store
            if old is not None and self._still_serves(old):
                self._serving("the store's client and its segment kept")
                return
            with self._lock:
                self._store = None
            if old is not None:
                self._close_store(old)
                self._forget_all()
        if self._store is None:
            try:
                store = self._connect()
            except Exception as exc:  # noqa: BLE001 - not installed, master unreachable
                self._degrade(str(exc))
                return
            if self._closed.is_set():           # the daemon stopped while it connected
                self._close_store(store, CLOSE_WAIT_S)
                return
            with self._lock:
                self._store = store
            log.info("cluster tier: connected to the store (node %s)", self.directory.node)
        try:
            self._store.exists([PROBE])        # the master answers (its error else)
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)
            return
        self._serving()

    def _serving(self, note: str = "") -> None:
        st = self._stats
        with self._lock:
            if st.health is not TierHealth.OK:
                log.info("cluster tier: serving (was %s%s)%s", st.health,
                         f": {st.reason}" if st.reason else "", f"; {note}" if note else "")
                st.health, st.reason = TierHealth.OK, ""

    def _still_serves(self, store: Store) -> bool:
        """Whether a degraded tier's client answers again over a store that has not lost
        what this node knew of it (a few of the newest keys asked about; True when it knew
        none)."""
        try:
            store.exists([PROBE])
            known = self.directory.sample(8)
            return not known or any(store.exists([block_name(ns, k) for ns, k in known]))
        except Exception:  # noqa: BLE001 - a client that fails is not kept
            return False

    @staticmethod
    def _close_store(store: Store, wait_s: float | None = None) -> None:
        """Close a client (`wait_s`: give up waiting after that long: Mooncake's close tells
        the master it leaves, ~15 s when the master is down; the process may exit meanwhile)."""
        def close() -> None:
            try:
                store.close()
            except Exception:
                log.exception("cluster tier: closing the store's client")

        if wait_s is None:
            close()
            return
        closer = threading.Thread(target=close, name="kvd-cluster-close", daemon=True)
        closer.start()
        closer.join(wait_s)

    def _forget_all(self) -> None:
        known = self.directory.clear()
        keys = [TierKey(ns, k) for ns, ks in known.items() for k in ks]
        if keys and self.on_named is not None:
            self.on_named(keys, False)

    # ------------------------------------------------------------------ stats
    def stats(self) -> TierStats:
        """The counters; `blocks` what the store holds as far as this node knows (its own and
        the ones its engines' lookups found), `used_bytes` those blocks at their namespace's
        size."""
        counts = self.directory.counts()
        with self._lock:
            st = self._stats
            st.blocks = sum(counts.values())
            st.used_bytes = sum(n * self._block_bytes.get(ns, 0) for ns, n in counts.items())
            return dataclasses.replace(st)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._puts.shutdown(wait=True, cancel_futures=True)   # a call in flight: ~4 s at most
        self._gets.shutdown(wait=True, cancel_futures=True)
        self._finds.shutdown(wait=True, cancel_futures=True)
        self._keeper.join(timeout=10)
        store, self._store = self._store, None
        if store is not None:
            self._close_store(store, CLOSE_WAIT_S)
