"""Registers the mapped pool for DMA chunk by chunk, in a background thread.

A worker is ready to copy as soon as it has mapped the pool: nothing is registered up front
(cudaHostRegister costs ~50 ms/GiB and one call over a large pool can hold driver locks for
seconds). This thread registers chunks one at a time, those a transfer asked for first; a
transfer that touches a chunk not registered yet is not held up, it takes a path that reads
pageable memory correctly (chain.route). `register`/`unregister` are injected so the CPU tests
drive the same thread with fakes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from .pin_table import PinStatus, PinTable, Registration

log = logging.getLogger(__name__)


class Pinner:
    def __init__(self, chunk_bytes: int, register: Callable[[int, int], Registration],
                 unregister: Callable[[int], None],
                 thread_init: Callable[[], None] | None = None) -> None:
        self.table = PinTable(chunk_bytes)
        self._register = register
        self._unregister = unregister
        self._thread_init = thread_init
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._warned = False
        self.registered_bytes = 0
        self.register_seconds = 0.0      # wall time inside register calls

    def add_region(self, base: int, size: int) -> None:
        with self._cond:
            self.table.add_region(base, size)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvd-pin", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def remove_region(self, base: int) -> None:
        """Unregister and forget a region; the caller has finished every copy touching it."""
        with self._cond:
            self.table.retire_region(base)
            while self.table.region_busy(base):
                self._cond.wait()
            jobs = self.table.remove_region(base)
        for job in jobs:
            self._unregister(job.address)

    def status(self, starts: np.ndarray, lengths: np.ndarray) -> PinStatus:
        """Pin state of the host ranges a transfer touches; chunks not registered yet are
        moved to the front of the queue. ValueError for a range outside the mapped pool."""
        with self._cond:
            span = self.table.span(starts, lengths)
            if span is not None and self.table.span_direct(span):
                return PinStatus(True, True)        # the steady state, without a sort
            chunks = self.table.chunks_for(starts, lengths)
            status = self.table.status(chunks)
            if not status.pinned and self.table.want(chunks):
                self._cond.notify_all()
        return status

    def wait_settled(self, timeout: float) -> bool:
        """Block until every chunk has been tried (benchmarks, tests); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.table.settled:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        if self._thread_init is not None:
            try:
                self._thread_init()
            except Exception:
                log.exception("the pool registration thread could not start; copies read "
                              "pageable memory (slower, still exact)")
                return
        while True:
            with self._cond:
                job = self.table.next_job()
                while job is None and not self._stop:
                    self._cond.wait()
                    job = self.table.next_job()
                if self._stop:
                    if job is not None:
                        self.table.finish(job, Registration(False, False))
                    self._cond.notify_all()
                    return
            assert job is not None          # the loop above waits until one or a stop
            started = time.perf_counter()
            try:
                result = self._register(job.address, job.size)
            except Exception:
                log.exception("registering pool chunk %#x (+%d) failed", job.address, job.size)
                result = Registration(False, False)
            seconds = time.perf_counter() - started
            if not result.pinned and not self._warned:
                self._warned = True
                log.warning("could not register pool chunk %#x (+%d bytes) for DMA; copies "
                            "touching it read pageable memory (slower, still exact)",
                            job.address, job.size)
            with self._cond:
                self.table.finish(job, result)
                if result.pinned:
                    self.registered_bytes += job.size
                    self.register_seconds += seconds
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread and unregister everything; no copy may be in flight."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._cond:
            jobs = self.table.registered()
        for job in jobs:
            self._unregister(job.address)
