"""Work for a pool of I/O threads, handed over in batches as the threads fall behind.

An item added while a thread is free runs at once, alone (no added latency); items added while
every thread is busy wait together and go to the next free thread as one batch. A batch is a
`threads`-th of what waits (at most `max_batch`): another job is queued for the rest, so a
burst is shared by every thread and the drive still sees `threads` requests at once. So a busy
tier pays its per-call costs (a job, the GIL, a journal write) once per batch instead of once
per block, and an idle one is no slower. Once the pool shuts down (the tier closes), what was
added before still runs (a job left finishes the rest itself); what is added after is handed
to `cancel`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")
MAX_BATCH = 64


class IoBatches(Generic[T]):
    """Items for `run(batch)` on `pool`'s threads (see the module doc); thread-safe."""

    def __init__(self, pool: ThreadPoolExecutor, run: Callable[[list[T]], None], threads: int,
                 cancel: Callable[[list[T]], None], max_batch: int = MAX_BATCH) -> None:
        """`cancel(items)`: items added once the pool is shut down (the tier is closing),
        which no thread will run: the caller ends them (on the adding thread)."""
        self._pool = pool
        self._run = run
        self._cancel = cancel
        self._threads = max(1, threads)
        self._max = max(1, max_batch)
        self._lock = threading.Lock()
        self._items: list[T] = []
        self._queued = False              # a job is submitted that has not started yet

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: T) -> None:
        with self._lock:
            self._items.append(item)
            if self._queued:
                return                    # the queued job takes it
            self._queued = True
        if not self._submit():
            with self._lock:
                items, self._items = self._items, []
                self._queued = False
            if items:
                self._cancel(items)

    def _submit(self) -> bool:
        try:
            self._pool.submit(self._job)
        except RuntimeError:              # the pool is shut down (closing)
            return False
        return True

    def _job(self) -> None:
        """On a pool thread: a share of what waits; the rest to another thread meanwhile, or,
        once the pool is shutting down, by this one (what was added before still runs)."""
        while True:
            with self._lock:
                take = min(self._max, -(-len(self._items) // self._threads))
                batch = self._items[:take]
                del self._items[:take]
                more = self._queued = bool(self._items)
            handed_on = more and self._submit()
            if batch:
                self._run(batch)
            if not more or handed_on:
                return
