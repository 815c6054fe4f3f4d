"""Registering the pool per chunk in the background (pin_table.py, pinner.py), with fake
register calls: what a plan needs, who goes first, failures, removal, shutdown."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvd_client.dataplane.pin_table import PinState, PinTable, Registration
from kvd_client.dataplane.pinner import Pinner

MIB = 1 << 20
BASE = 0x7F00_0000_0000


def ranges(*pairs: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([a for a, _ in pairs], dtype=np.int64),
            np.array([n for _, n in pairs], dtype=np.int64))


def test_chunks_a_plan_touches():
    t = PinTable(4 * MIB)
    t.add_region(BASE, 10 * MIB)                       # chunks of 4, 4, 2 MiB
    t.add_region(BASE + 64 * MIB, 4 * MIB)             # chunk 3
    assert t.chunks_for(*ranges((BASE, 1))).tolist() == [0]
    assert t.chunks_for(*ranges((BASE + 4 * MIB - 1, 2))).tolist() == [0, 1]
    assert t.chunks_for(*ranges((BASE + 1, 10 * MIB - 1))).tolist() == [0, 1, 2]
    assert t.chunks_for(*ranges((BASE + 64 * MIB + 5, 7), (BASE + 9 * MIB, 0))).tolist() == [3]
    assert t.chunks_for(*ranges()).tolist() == []
    for bad in ((BASE + 10 * MIB - 1, 2), (BASE - 1, 1), (BASE + 20 * MIB, 1)):
        with pytest.raises(ValueError, match="outside the mapped pool"):
            t.chunks_for(*ranges(bad))
    assert t.job(2).size == 2 * MIB


def test_span_is_a_superset_found_without_a_sort():
    t = PinTable(4 * MIB)
    t.add_region(BASE, 16 * MIB)
    t.add_region(BASE + 64 * MIB, 4 * MIB)
    assert t.span(*ranges((BASE + 5 * MIB, 10), (BASE + 13 * MIB, MIB))) == (1, 3)
    assert t.span(*ranges((BASE, 4 * MIB))) == (0, 0)
    assert t.span(*ranges((BASE, 1), (BASE + 64 * MIB, 1))) is None   # two regions
    assert t.span(*ranges()) is None
    for _ in range(3):
        t.finish(t.next_job(), Registration(True, True))
    assert t.span_direct((0, 2)) and not t.span_direct((1, 3))


def test_regions_must_not_overlap_and_start_on_a_page():
    t = PinTable(4 * MIB)
    t.add_region(BASE, 8 * MIB)
    with pytest.raises(ValueError, match="overlaps"):
        t.add_region(BASE + 4 * MIB, 8 * MIB)
    with pytest.raises(ValueError, match="page"):
        t.add_region(BASE + 100 * MIB + 1, MIB)
    with pytest.raises(ValueError, match="multiple"):
        PinTable(1000)


def test_wanted_chunks_go_first_then_the_rest_in_order():
    t = PinTable(MIB)
    t.add_region(BASE, 6 * MIB)
    assert t.want(np.array([4, 2, 4])) == 2
    order = []
    while (job := t.next_job()) is not None:
        order.append(job.chunk)
        t.finish(job, Registration(True, job.chunk != 5))
    assert order == [4, 2, 0, 1, 3, 5]
    assert t.status(np.array([0, 1])) .direct
    s = t.status(np.array([4, 5]))
    assert s.pinned and not s.direct
    assert t.settled and t.count(PinState.DIRECT) == 5 and t.count(PinState.PINNED) == 1


def test_a_failed_chunk_is_neither_pinned_nor_retried():
    t = PinTable(MIB)
    t.add_region(BASE, 2 * MIB)
    job = t.next_job()
    t.finish(job, Registration(False, False))
    assert not t.status(np.array([0])).pinned and t.want(np.array([0])) == 0
    assert t.next_job().chunk == 1 and t.next_job() is None
    with pytest.raises(RuntimeError):
        t.finish(job, Registration(True, True))      # not BUSY any more


def test_remove_region_returns_what_to_unregister():
    t = PinTable(MIB)
    t.add_region(BASE, 3 * MIB)
    for _ in range(2):
        t.finish(t.next_job(), Registration(True, True))
    busy = t.next_job()
    with pytest.raises(RuntimeError):
        t.remove_region(BASE)
    t.finish(busy, Registration(False, False))
    assert [j.address for j in t.remove_region(BASE)] == [BASE, BASE + MIB]
    with pytest.raises(ValueError):
        t.chunks_for(*ranges((BASE, 1)))
    t.add_region(BASE, MIB)                           # a new mapping at the same address
    assert t.next_job().chunk == 3


class FakeDriver:
    """Registration that takes `delay` seconds, optionally failing or not direct."""

    def __init__(self, delay: float = 0.0, fail: set[int] | None = None) -> None:
        self.delay = delay
        self.fail = fail or set()
        self.registered: list[int] = []
        self.unregistered: list[int] = []
        self.threads: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()

    def register(self, address: int, size: int) -> Registration:
        self.gate.wait(10)
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        if address in self.fail:
            return Registration(False, False)
        self.registered.append(address)
        return Registration(True, True)

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def test_ready_at_once_and_registered_in_the_background():
    drv = FakeDriver(delay=0.01)
    inits = []
    p = Pinner(MIB, drv.register, drv.unregister, thread_init=lambda: inits.append(1))
    started = time.monotonic()
    p.add_region(BASE, 64 * MIB)
    assert time.monotonic() - started < 0.1              # nothing registered up front
    assert not p.status(*ranges((BASE, 10))).pinned       # a transfer is not held up
    assert p.wait_settled(10)
    assert p.status(*ranges((BASE, 64 * MIB))).direct
    assert inits == [1] and drv.threads == {"kvd-pin"}
    assert p.registered_bytes == 64 * MIB and p.register_seconds > 0
    p.close()
    assert sorted(drv.unregistered) == sorted(drv.registered)


def test_a_transfer_moves_its_chunks_to_the_front():
    drv = FakeDriver()
    drv.gate.clear()                                      # hold the thread at chunk 0
    p = Pinner(MIB, drv.register, drv.unregister)
    p.add_region(BASE, 32 * MIB)
    deadline = time.monotonic() + 10
    while p.table.count(PinState.BUSY) == 0:              # the thread holds chunk 0
        assert time.monotonic() < deadline
        time.sleep(0.001)
    p.status(*ranges((BASE + 20 * MIB, MIB)))             # wants chunk 20
    drv.gate.set()
    assert p.wait_settled(10)
    assert drv.registered[:2] == [BASE, BASE + 20 * MIB]
    p.close()


def test_status_fast_path_and_exact_path_agree():
    drv = FakeDriver(fail={BASE + 2 * MIB})
    p = Pinner(MIB, drv.register, drv.unregister)
    p.add_region(BASE, 4 * MIB)
    assert p.wait_settled(10)
    # the span [0, 3] holds the failed chunk 2, but these ranges never touch it
    status = p.status(*ranges((BASE + 10, 10), (BASE + 3 * MIB, 10)))
    assert status.pinned and status.direct
    assert not p.status(*ranges((BASE + 2 * MIB + 5, 1))).pinned
    p.close()


def test_failures_and_broken_threads_leave_chunks_unpinned_not_wrong():
    drv = FakeDriver(fail={BASE + MIB})
    p = Pinner(MIB, drv.register, drv.unregister)
    p.add_region(BASE, 3 * MIB)
    assert p.wait_settled(10)
    assert not p.status(*ranges((BASE, 3 * MIB))).pinned
    assert p.status(*ranges((BASE + 2 * MIB, 10))).direct
    p.close()

    def boom() -> None:
        raise RuntimeError("no context")

    q = Pinner(MIB, drv.register, drv.unregister, thread_init=boom)
    q.add_region(BASE + 64 * MIB, MIB)
    assert not q.wait_settled(0.3)
    assert not q.status(*ranges((BASE + 64 * MIB, 1))).pinned
    q.close()


def test_remove_region_waits_for_the_chunk_in_flight():
    drv = FakeDriver(delay=0.2)
    p = Pinner(MIB, drv.register, drv.unregister)
    p.add_region(BASE, 2 * MIB)
    while p.table.count(PinState.BUSY) == 0:              # chunk 0 is being registered
        time.sleep(0.001)
    p.remove_region(BASE)
    assert drv.unregistered == drv.registered == [BASE]
    with pytest.raises(ValueError):
        p.status(*ranges((BASE, 1)))
    p.close()
