"""Pages in and out of kvd for an engine whose storage calls come from several threads.

SGLang's HiCache controller calls its storage backend from its own threads: the prefetch
thread asks which pages exist, the prefetch I/O thread reads them, the backup thread writes
them, each in batches of up to 128 pages. `OffloadSession` (kvd_client/offload/session.py) is
one scheduler's: so every call here is one session step taken under a lock (its lookups,
pins or reserved slots, then `end_step`, which writes the step's records into the session's
channel: shared memory, no round trip to the daemon), and the copies run outside the lock,
so a large read never holds up an existence query. What keeps a copy safe without the lock:
a load's slots stay readable until `finish_loads` (the session publishes the oldest index
epoch its loads in flight may act on), and a store's slots were granted to this session alone
and are readable by nobody until `complete_store`.

Each load and store call is a request of its own to the daemon (its pins and stores are
ordered for eviction by their positions in the sequence, and the request ends with the
call). Nothing here waits for the daemon: a daemon that is down, restarting or slow answers
as a miss, or a store not made, and the client reconnects by itself (kvd_client/client.py).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvd_client.client import KvdClient
from kvd_client.offload.session import OffloadSession
from kvd_client.transfer_report import TransferReporter

log = logging.getLogger(__name__)

MISS, HIT, PENDING = 0, 1, 2
MAX_SAMPLES = 4096                 # per-call samples kept for get_stats, between two reads
ERROR_LOG_INTERVAL_S = 10.0

# copy(pool base address, slot offsets) -> bytes copied, for the first len(offsets) pages
Copy = Callable[[int, Sequence[int]], int]


@dataclass
class PageCounters:
    """What the calls did since the last `take` (bounded samples), and in all."""
    loads: list[tuple[int, float]] = field(default_factory=list)    # (pages, seconds)
    stores: list[tuple[int, float]] = field(default_factory=list)
    failures: int = 0

    def add(self, samples: list[tuple[int, float]], pages: int, seconds: float) -> None:
        if len(samples) < MAX_SAMPLES:
            samples.append((pages, seconds))


class PageStore:
    """One engine rank's pages in one kvd namespace (see the module doc)."""

    def __init__(self, client: KvdClient, session: OffloadSession, *, page_bytes: int,
                 name: str = "kvd") -> None:
        self.client = client
        self.session = session
        self.page_bytes = page_bytes
        self.name = name
        self.counters = PageCounters()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._reporter = TransferReporter(client.socket_path, engine_id=client.engine.engine_id)
        self._views: tuple[Any, Any] | None = None      # (pool mapping, its numpy view)
        self._logged_at = 0.0
        self._closed = False

    # ---------------------------------------------------------------- queries
    def exists(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are loadable now. Keys a tier below the pool
        holds answer HIT_PENDING and are promoted on the way (the scan goes on over them, so
        a whole held-below run is asked for at once), but count as absent here: the caller
        reads what is loadable now, and the promoted pages serve the next call."""
        with self._lock:
            if self._closed:
                return 0
            session = self.session
            lookup = session.lookup
            found = 0
            counting = True
            for key in keys:
                answer = lookup(key)
                if answer == HIT:
                    if counting:
                        found += 1
                    continue
                if answer != PENDING:
                    break
                counting = False
            session.end_step()
            return found

    # ------------------------------------------------------------------ loads
    def load(self, keys: Sequence[bytes], copy: Copy, first_position: int = 0) -> int:
        """Copy the loadable pages among `keys`, from the first up to the first that is not,
        with `copy`; how many were copied (0 when the copy failed)."""
        with self._lock:
            if self._closed:
                return 0
            session = self.session
            lookup = session.lookup
            hits: list[bytes] = []
            for key in keys:
                if lookup(key) != HIT:
                    break
                hits.append(key)
            if not hits:
                session.end_step()
                return 0
            req = f"sgl-load-{next(self._ids)}"
            positions = list(range(first_position, first_position + len(hits)))
            offsets = session.start_loads(hits, req, positions)
            cut = next((i for i, o in enumerate(offsets) if o is None), len(offsets))
            base = self._pool_base(session)
            session.end_step()
        started = time.perf_counter()
        done = copied = 0
        try:
            if base is not None and cut:
                copied = copy(base, offsets[:cut])
                done = cut
        except Exception:  # noqa: BLE001 - never into SGLang's threads: counted, logged by PageStore.failed
            self.failed("a load")
            done = 0
        finally:
            seconds = time.perf_counter() - started
            with self._lock:
                if not self._closed:
                    session.finish_loads(hits, req)
                    session.request_finished(req)
                    session.end_step()
        if done:
            self.counters.add(self.counters.loads, done, seconds)
            self._reporter.record(is_store=False, size=copied, seconds=seconds)
        return done

    # ----------------------------------------------------------------- stores
    def store(self, keys: Sequence[bytes], copy: Callable[[int, Sequence[int], list[int]], int],
              first_position: int = 0) -> int:
        """Store the pages of `keys` kvd does not hold yet: `copy(base, offsets, indices)`
        writes page `keys[indices[i]]` into the slot at `offsets[i]`. How many of `keys`, from
        the first, are now held (stored now, or already): all of them, or the prefix the
        session's slots held at once (a call larger than the reserve stores what fits; the
        reserve grows for the next), or 0 (no daemon, a failed copy)."""
        if not keys:
            return 0
        with self._lock:
            if self._closed:
                return 0
            session = self.session
            req = f"sgl-store-{next(self._ids)}"
            positions = list(range(first_position, first_position + len(keys)))
            # (the step's start adopts a new connection: only then does `available` say)
            stored = session.store_slots(keys, req, positions)
            if stored is None and session.reserve_held:       # short: the prefix that fits
                keys = keys[:session.reserve_held]
                stored = session.store_slots(keys, req, positions[:len(keys)])
            base = self._pool_base(session) \
                if stored is not None and session.available else None
            if stored is None or base is None:
                session.request_finished(req)
                session.end_step()
                return 0
            new, offsets = stored
            if not new:
                session.request_finished(req)
                session.end_step()
                return len(keys)
            session.end_step()
        where = {key: i for i, key in enumerate(keys)}
        started = time.perf_counter()
        ok = False
        copied = 0
        try:
            copied = copy(base, offsets, [where[key] for key in new])
            ok = True
        except Exception:  # noqa: BLE001 - never into SGLang's threads: counted, logged by PageStore.failed
            self.failed("a store")
        finally:
            seconds = time.perf_counter() - started
            with self._lock:
                if not self._closed:
                    session.complete_store(new, req, ok)
                    session.request_finished(req)
                    session.end_step()
        if ok:
            self.counters.add(self.counters.stores, len(new), seconds)
            self._reporter.record(is_store=True, size=copied, seconds=seconds)
        return len(keys) if ok else 0

    # ------------------------------------------------------------------ admin
    def reset(self) -> None:
        """Drop every page of the namespace (as vLLM's reset_cache does), in the next step."""
        with self._lock:
            if not self._closed:
                self.session.reset()
                self.session.end_step()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._views = None
            self.session.close()
        self._reporter.close()
        self.client.close()

    # -------------------------------------------------------------- internals
    def _pool_base(self, session: OffloadSession) -> int | None:
        """The address of the pool the session's offsets are in (None: the client moved to
        another pool since, so those offsets name nothing here). The numpy view held keeps
        the mapping alive while a copy uses it, even if the client retires it meanwhile."""
        pool_id, pool = self.client.current_pool()
        if pool is None or pool_id != session.pool_id or pool.closed:
            return None
        views = self._views
        if views is None or views[0] is not pool:
            views = self._views = (pool, pool.numpy())
        return int(views[1].ctypes.data)

    def failed(self, what: str) -> None:
        """Count a call that failed and log it with its traceback, at most every
        ERROR_LOG_INTERVAL_S (SGLang's threads call again at once: no flood)."""
        self.counters.failures += 1
        now = time.monotonic()
        if now - self._logged_at >= ERROR_LOG_INTERVAL_S:
            self._logged_at = now
            log.exception("kvd %s: %s failed (%d so far); the pages are not copied",
                          self.name, what, self.counters.failures)
