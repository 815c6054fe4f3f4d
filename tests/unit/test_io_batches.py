"""IoBatches (kvd_server/tiers/io_batches.py): an item added while a thread is free runs at
once and alone; what arrives while every thread is busy goes out in batches shared by the
threads; every item runs exactly once; after the pool is shut down, items still run."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from kvd_server.tiers.io_batches import IoBatches


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []          # in the order they started
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.started = threading.Semaphore(0)

    def run(self, batch: list[int]) -> None:
        with self.lock:
            self.batches.append(batch)
        self.started.release()
        assert self.release.wait(10)


def test_a_lone_item_runs_alone_and_a_backlog_is_shared():
    rec = Recorder()
    pool = ThreadPoolExecutor(2)
    batches = IoBatches(pool, rec.run, threads=2, max_batch=4)
    batches.add(0)
    batches.add(1)                            # both threads busy from here
    assert rec.started.acquire(timeout=10) and rec.started.acquire(timeout=10)
    for i in range(2, 14):
        batches.add(i)
    assert len(batches) == 12                 # waiting for a free thread
    rec.release.set()
    pool.shutdown(wait=True)
    ran = sorted(i for b in rec.batches for i in b)
    assert ran == list(range(14))             # every item once
    assert sorted(rec.batches[:2]) == [[0], [1]]
    later = rec.batches[2:]
    assert all(1 <= len(b) <= 4 for b in later)
    assert len(later) < 12                    # batched, not one job per item
    assert len(batches) == 0


def test_items_still_run_once_the_pool_is_shut_down():
    seen: list[list[int]] = []
    pool = ThreadPoolExecutor(1)
    batches = IoBatches(pool, seen.append, threads=1)
    pool.shutdown(wait=True)
    batches.add(7)
    assert seen == [[7]]
