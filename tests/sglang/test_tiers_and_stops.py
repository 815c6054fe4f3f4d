"""SGLang's backend over a daemon with a disk tier, and over a daemon that stops answering.

- Pages the pool evicted to the disk tier: `batch_exists` counts them absent at first (each is
  promoted on the way, docs/sglang.md says why SGLang's prefetch stops there), then present
  once promoted, and `batch_get_v1` reads them back byte-exact: the promotion path vLLM's
  engines use, driven from SGLang's calls.
- The daemon SIGSTOPped (alive, answering nothing): every call SGLang makes returns within
  its bound, none raises, none serves a wrong byte; stores go on into the rank's reserve until
  it is spent, then are declined. After SIGCONT the backend stores and reads as before.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.sglang.sgl_worker import backend_for, keys_for
from tests.support import sglang_env as E
from tests.support.disk_tier import disk_env, tier_of, wait_health
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc

WAIT_S = 20.0
BATCH = 16                   # pages a set (the reserve holds a quarter of the 128-slot pool)


def big_page_pool(pages: int = 48):
    """A host pool of 128 KiB pages (8 layers, 4 heads of 64, 16 tokens, bf16)."""
    return E.mha_host_pool("page_first", layers=8, heads=4, head_dim=64, page_size=16,
                           pages=pages)


def set_all(backend, pool, keys: list[str], pages: list[int]) -> None:
    """`batch_set_v1` until every page is held (the reserve refills between calls)."""
    deadline = time.monotonic() + WAIT_S
    while (done := backend.batch_set_v1(keys, E.page_indices(pool, pages))) != \
            [True] * len(keys):
        assert time.monotonic() < deadline, f"stored {sum(done)} of {len(keys)}"
        time.sleep(0.02)


def test_pages_the_disk_holds_are_promoted_and_read_back_byte_exact(start_daemon, tmp_path):
    daemon = start_daemon("--pool-size", "16MiB", "--extent-size", "4MiB",
                          env=disk_env(tmp_path / "disk"))
    wait_health(daemon, "ok", "the disk tier to open")
    pool = big_page_pool()
    backend = backend_for(daemon.socket, pool)
    try:
        assert backend._store.client.wait_available(WAIT_S)
        written: dict[str, bytes] = {}
        batches = [keys_for(f"disk/{b}", BATCH) for b in range(12)]    # 192 pages, 128 slots
        for b, keys in enumerate(batches):
            data = E.fill_pages(pool, list(range(BATCH)), seed=100 + b)
            set_all(backend, pool, keys, list(range(BATCH)))
            written.update(zip(keys, (data[p] for p in range(BATCH)), strict=True))
        ready = daemon.stats()["blocks"]["ready"]
        below = len(written) - ready
        assert below >= BATCH, f"the pool evicted only {below} pages"
        wait_until(lambda: tier_of(daemon)["blocks"] >= below and
                   tier_of(daemon)["queue_depth"] == 0, WAIT_S,
                   f"{below} pages to be written to the disk tier")
        first = batches[0]                 # stored first: evicted first, held by the disk
        assert backend.batch_exists(first) == 0      # promoted on the way, absent now
        assert wait_until(lambda: backend.batch_exists(first) == BATCH, WAIT_S,
                          "the first batch to be promoted into the pool")
        targets = list(range(BATCH, 2 * BATCH))
        E.fill_pages(pool, targets, seed=7)
        assert backend.batch_get_v1(first, E.page_indices(pool, targets)) == [True] * BATCH
        for page, key in zip(targets, first, strict=True):
            assert E.page_bytes(pool, page * pool.page_size) == written[key], key
    finally:
        backend.close()


def test_a_stopped_daemon_costs_each_call_no_more_than_its_bound(daemon):
    pool = big_page_pool()
    backend = backend_for(daemon.socket, pool, extra={"kvd_deadline_ms": 200})
    stopped = False
    try:
        assert backend._store.client.wait_available(WAIT_S)
        held = keys_for("stop/held", BATCH)
        data = E.fill_pages(pool, list(range(BATCH)), seed=3)
        set_all(backend, pool, held, list(range(BATCH)))
        assert wait_until(lambda: backend.batch_exists(held) == BATCH, WAIT_S, "the pages held")
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        stopped = True
        targets = list(range(BATCH, 2 * BATCH))
        slowest = 0.0
        stored = declined = 0
        for round_ in range(40):
            t0 = time.monotonic()
            present = backend.batch_exists(held)
            got = backend.batch_get_v1(held, E.page_indices(pool, targets))
            done = backend.batch_set_v1(keys_for(f"stop/new/{round_}", 4),
                                        E.page_indices(pool, list(range(4))))
            slowest = max(slowest, time.monotonic() - t0)
            assert isinstance(present, int) and 0 <= present <= BATCH
            assert len(got) == BATCH and len(done) == 4
            for page, ok, source in zip(targets, got, range(BATCH), strict=True):
                if ok:                       # a page read is the page stored, never another
                    assert E.page_bytes(pool, page * pool.page_size) == data[source]
            stored += sum(done)
            declined += len(done) - sum(done)
        assert slowest < 2.0, f"a round of calls took {slowest:.2f} s with the daemon stopped"
        assert declined > 0, "the reserve never ran out while the daemon was stopped"
        os.kill(daemon.proc.pid, signal.SIGCONT)
        stopped = False
        fresh = keys_for("stop/after", 4)
        after = E.fill_pages(pool, list(range(4)), seed=9)
        set_all(backend, pool, fresh, list(range(4)))
        assert wait_until(lambda: backend.batch_exists(fresh) == 4, WAIT_S,
                          "the pages stored after SIGCONT")
        assert backend.batch_get_v1(fresh, E.page_indices(pool, targets[:4])) == [True] * 4
        for page, source in zip(targets[:4], range(4), strict=True):
            assert E.page_bytes(pool, page * pool.page_size) == after[source]
    finally:
        if stopped:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        backend.close()
