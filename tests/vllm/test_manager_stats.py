"""vLLM's own offload metrics for a kvd engine: `KvdOffloadingManager.get_stats`, through vLLM
0.33's classes (the manager vLLM's connector built from KvdOffloadingSpec, its scheduler, its
Prometheus exporter) against a real `kvd serve`.

The manager-level tests follow vLLM's own CPU-manager metric tests (test_manager.py:
`..._reports_cache_usage_gauge`, `..._cache_write_and_read_usage_gauges`,
`..._clears_write_usage_after_failed_store`, `..._allocation_size_histogram`,
`..._allocation_size_on_eviction_failure`) with kvd's capacity, the namespace's slots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
)
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics as M

from kvd_client.offload.admission import OfferCounter
from tests.support.daemon import Daemon
from tests.support.waits import wait_until

from .harness import Engine
from .offload_stats import END, capture, key, keys, prometheus, sample
from .prompts import BS, prompt

pytestmark = [pytest.mark.vllm]

SLOT = 4096                      # the harness's 1 KiB blocks, in 4 KiB slots
SLOTS = 64                       # a small namespace, so usage fractions are coarse
USAGE = (M.CPU_CACHE_USAGE_PERC, M.CPU_CACHE_WRITE_USAGE_PERC, M.CPU_CACHE_READ_USAGE_PERC)
ALLOC = M.CPU_ALLOCATION_SIZE


@pytest.fixture
def small(start_daemon: Callable[..., Daemon]) -> Daemon:
    """A daemon whose pool holds SLOTS slots of the harness's layout."""
    size = str(SLOTS * SLOT)
    return start_daemon("--pool-size", size, "--extent-size", size)


@pytest.fixture
def engine(small: Daemon) -> Iterator[Engine]:
    e = Engine(small.socket)
    assert e.manager.client.wait_available(10), "engine could not reach kvd"
    yield e
    e.close()


def reduced(manager: Any) -> dict[str, float]:
    stats = manager.get_stats()
    assert stats is not None, "get_stats reported nothing: vLLM's offload series stay empty"
    return stats.reduce()


def check_usage(manager: Any, write: int, read: int) -> None:
    """The gauges, in blocks of the namespace's SLOTS (vLLM's fractions of its capacity)."""
    got = reduced(manager)
    assert got[M.CPU_CACHE_WRITE_USAGE_PERC] == pytest.approx(write / SLOTS)
    assert got[M.CPU_CACHE_READ_USAGE_PERC] == pytest.approx(read / SLOTS)
    assert got[M.CPU_CACHE_USAGE_PERC] == pytest.approx((write + read) / SLOTS)


def hit(manager: Any, k: OffloadKey, ctx: ReqContext) -> None:
    """Step until `k` answers HIT (the engine's own completed store, or the daemon's index)."""
    def found() -> bool:
        if manager.lookup(k, ctx) is LookupResult.HIT:
            return True
        manager.on_schedule_end(END)
        return False
    wait_until(found, 5, "the stored block to answer HIT")


def test_usage_gauges_follow_the_stores_and_loads_in_flight(engine):
    m, ctx = engine.manager, ReqContext(req_id="r")
    check_usage(m, write=0, read=0)
    out = m.prepare_store(keys([1, 2]), ctx)
    assert out is not None and out.keys_to_store == keys([1, 2])
    check_usage(m, write=2, read=0)                 # vLLM: 2 of 4 pinned -> 0.5
    m.complete_store(keys([1, 2]), ctx)
    check_usage(m, write=0, read=0)                 # ready blocks are evictable: not "used"
    m.on_schedule_end(END)

    hit(m, key(1), ctx)
    m.prepare_load(keys([1]), ctx)
    check_usage(m, write=0, read=1)
    m.complete_load(keys([1]), ctx)
    check_usage(m, write=0, read=0)
    m.on_schedule_end(END)

    # Concurrent write and read pins are both reflected, and add up.
    hit(m, key(2), ctx)
    assert m.prepare_store(keys([3, 4]), ctx).keys_to_store == keys([3, 4])
    m.prepare_load(keys([2]), ctx)
    check_usage(m, write=2, read=1)
    m.complete_load(keys([2]), ctx)
    m.complete_store(keys([3, 4]), ctx, success=False)   # a failed store frees its pin too
    check_usage(m, write=0, read=0)
    m.on_schedule_end(END)


def test_allocation_sizes_are_the_new_blocks_of_each_store_offer(engine):
    m, ctx = engine.manager, ReqContext(req_id="r")
    m.prepare_store(keys([1, 2]), ctx)
    m.complete_store(keys([1, 2]), ctx)
    m.prepare_store(keys([1, 2, 3]), ctx)           # 1, 2 are there: one new block
    m.prepare_store(keys([1, 2]), ctx)              # nothing new: no sample
    got = reduced(m)
    assert got[f"{ALLOC}_count"] == 2 and got[f"{ALLOC}_sum"] == 3
    # Taken once: the gauges come every time, the samples only when new ones came.
    again = reduced(m)
    assert f"{ALLOC}_count" not in again and M.CPU_CACHE_USAGE_PERC in again
    # An offer kvd cannot hold now (more new blocks than the reserve) is sampled too, as
    # vLLM samples an allocation it then cannot make room for.
    m.complete_store(keys([3]), ctx)
    assert m.prepare_store(keys(list(range(100, 100 + 4 * SLOTS))), ctx) is None
    got = reduced(m)
    assert got[f"{ALLOC}_count"] == 1 and got[f"{ALLOC}_sum"] == 4 * SLOTS
    # No store_threshold: vLLM declares no stores_skipped series, so none is reported.
    assert M.STORES_SKIPPED not in got
    m.on_schedule_end(END)


def test_payload_is_the_one_vllms_own_calls_build(engine):
    """`take` writes vLLM's payload in one literal: the same types, values and info as the
    set_gauge / observe_histogram / increase_counter calls vLLM's CPU manager makes, with and
    without samples, with and without the store-threshold counter."""
    m, ctx = engine.manager, ReqContext(req_id="r")
    m.prepare_store(keys([1, 2, 3]), ctx)           # stores in flight: non-zero gauges
    stats = m._stats
    for sizes, counted in (([], False), ([3, 1, 4], False), ([2], True), ([], True)):
        if counted:                                  # as store_threshold >= 2 counts
            stats._admission = OfferCounter(2)
            stats._admission.skipped = 7
            stats._skipped_reported = 5
        stats._sizes = list(sizes)
        reference = stats.take_through_calls()
        if counted:
            stats._skipped_reported = 5
        stats._sizes = list(sizes)
        fast = stats.take()
        assert fast.data == reference.data
        assert type(fast) is type(reference) and not fast.is_empty()
        assert fast.reduce() == reference.reduce()
    stats._admission = None
    m.complete_store(keys([1, 2, 3]), ctx)
    m.on_schedule_end(END)


# --- through vLLM's scheduler and its Prometheus exporter -------------------------------------


def series(payloads: list[dict[str, Any]], name: str) -> list[float]:
    return [p["data"][name][()] for p in payloads if name in p.get("data", {})]


def test_scheduler_stats_move_vllms_cpu_tier_series(engine):
    prom, registry = prometheus(engine)
    payloads = capture(engine)
    tokens = prompt(1, 6 * BS)
    engine.add("a", tokens)
    engine.run()
    engine.add("b", tokens + [5, 6, 7])
    engine.run()
    assert engine.stats.hit_tokens["b"] == 6 * BS
    for payload in payloads:
        prom.observe(payload, 0)      # vLLM's frontend asserts every series is declared

    # The stores of a step are in flight when the step's stats are taken (vLLM's workers
    # start them at the next step): write usage, and usage, rise, then fall back to 0.
    writes = series(payloads, M.CPU_CACHE_WRITE_USAGE_PERC)
    assert max(writes) == pytest.approx(6 / SLOTS), writes
    assert max(series(payloads, M.CPU_CACHE_USAGE_PERC)) >= max(writes)
    for name in USAGE:
        assert sample(registry, name) == 0.0, name        # nothing in flight at the end
    assert sample(registry, f"{ALLOC}_count") >= 1
    assert sample(registry, f"{ALLOC}_sum") == 6          # a's 6 blocks, b's were there
    # The transfer series: kvd's workers report every copy to vLLM's connector.
    assert sample(registry, "vllm:kv_offload_store_bytes_total") == 6 * 1024
    assert sample(registry, "vllm:kv_offload_load_bytes_total") == 6 * 1024
    assert sample(registry, "vllm:kv_offload_store_size_count") >= 1
    assert sample(registry, "vllm:kv_offload_load_size_count") >= 1
