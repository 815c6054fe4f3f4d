"""IoBatches (kvd_server/tiers/disk/io_batches.py): an item added while a thread is free runs at
once and alone; what arrives while every thread is busy goes out in batches shared by the
threads; every item runs exactly once; what was added before the pool shut down still runs,
what is added after is cancelled."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kvd_server.tiers.disk.io_batches import IoBatches


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []          # in the order they started
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.started = threading.Semaphore(0)

    def cancel(self, batch: list[int]) -> None:
        raise AssertionError(f"cancelled {batch}")

    def run(self, batch: list[int]) -> None:
        with self.lock:
            self.batches.append(batch)
        self.started.release()
        assert self.release.wait(10)


def test_a_lone_item_runs_alone_and_a_backlog_is_shared():
    rec = Recorder()
    pool = ThreadPoolExecutor(2)
    batches = IoBatches(pool, rec.run, threads=2, cancel=rec.cancel, max_batch=4)
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


def test_a_backlog_added_before_shutdown_runs_and_later_items_are_cancelled():
    rec = Recorder()
    pool = ThreadPoolExecutor(1)
    cancelled: list[list[int]] = []
    batches = IoBatches(pool, rec.run, threads=1, cancel=cancelled.append, max_batch=2)
    batches.add(0)
    assert rec.started.acquire(timeout=10)       # the only thread is busy
    for i in range(1, 8):
        batches.add(i)
    closer = threading.Thread(target=pool.shutdown, kwargs={"wait": True})
    closer.start()                               # shutting down with a backlog waiting
    for _ in range(1000):                        # (bounded) until the pool refuses new jobs
        if getattr(pool, "_shutdown", True):
            break
        time.sleep(0.001)
    rec.release.set()
    closer.join(10)
    assert not closer.is_alive()
    assert sorted(i for b in rec.batches for i in b) == list(range(8))
    assert all(len(b) <= 2 for b in rec.batches)
    batches.add(8)                               # after: no thread will run it
    assert cancelled == [[8]] and len(batches) == 0
