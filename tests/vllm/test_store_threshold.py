"""vLLM's `store_threshold` admission filter for a kvd engine, through vLLM 0.33's classes against
a real `kvd serve`: a block is stored only once vLLM offered it `store_threshold` times (counted
over the last `max_tracker_size` offered keys), and the new blocks held back are counted in
`vllm:kv_offload_stores_skipped`.

The manager-level tests follow vLLM's own (test_manager.py: `test_filter_reused_manager`,
`..._reports_stores_skipped_counter`, `..._oversized_offer_makes_progress`,
`test_store_threshold_does_not_hide_ready_reuse`); the scheduler-level ones replay the same
requests through vLLM's scheduler with vLLM's own CPUOffloadingManager and with kvd, and
require the same hits for every request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from vllm.v1.kv_offload.base import OffloadingManager, ReqContext
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics as M
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from bench.traces import Request
from tests.support.daemon import Daemon

from .baseline import BaselineCPUSpec
from .harness import Engine
from .offload_stats import END, capture, key, keys, prometheus, sample
from .prompts import BS, prompt
from .random_traces import PAGE, RESERVE, random_trace

pytestmark = [pytest.mark.vllm]

SKIPPED = M.STORES_SKIPPED


class ThresholdBaselineSpec(BaselineCPUSpec):
    """vLLM's own CPUOffloadingManager with the store-threshold options vLLM's CPU spec
    reads (the baseline's worker copies nothing: only the scheduler's side is compared)."""

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            extra = self.extra_config
            self._manager = CPUOffloadingManager(
                num_chunks=self.num_chunks, cache_policy=self.policy, enable_events=False,
                store_threshold=int(extra.get("store_threshold", 0)),
                max_tracker_size=int(extra.get("max_tracker_size", 64_000)))
        return self._manager


@pytest.fixture
def engine_with(daemon: Daemon) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(**extra: object) -> Engine:
        e = Engine(daemon.socket, extra=dict(extra))
        assert e.manager.client.wait_available(10), "engine could not reach kvd"
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def skipped(manager: OffloadingManager) -> float:
    stats = manager.get_stats()
    assert stats is not None
    return stats.reduce()[SKIPPED]


def test_blocks_are_stored_from_their_threshold_th_offer(engine_with):
    m = engine_with(store_threshold=2, max_tracker_size=3).manager
    ctx = ReqContext(req_id="r")
    out = m.prepare_store(keys([1, 2, 3]), ctx)
    assert out is not None and out.keys_to_store == []     # first offers: held back
    assert skipped(m) == 3
    assert skipped(m) == 0                                  # a counter: taken once
    out = m.prepare_store(keys([1, 2, 4]), ctx)
    assert out.keys_to_store == keys([1, 2])                # offered twice now
    assert skipped(m) == 1
    m.complete_store(keys([1, 2]), ctx)
    m.on_schedule_end(END)
    # The tracker holds 3 keys: 1 and 3 aged out. Key 1 is stored: offering it again skips
    # nothing (the threshold applies to new stores only); key 3 starts again from one.
    out = m.prepare_store(keys([1, 3]), ctx)
    assert out.keys_to_store == []
    assert skipped(m) == 1
    m.on_schedule_end(END)


def test_an_offer_larger_than_the_tracker_still_makes_progress(engine_with):
    m = engine_with(store_threshold=2, max_tracker_size=3).manager
    ctx = ReqContext(req_id="r")
    offer = keys([10, 11, 12, 13, 14])
    assert m.prepare_store(offer, ctx).keys_to_store == []
    # The first three were counted (an offer never evicts its own counts): stored now.
    assert m.prepare_store(offer, ctx).keys_to_store == keys([10, 11, 12])
    m.on_schedule_end(END)


def test_no_threshold_stores_at_the_first_offer(engine_with):
    m = engine_with(store_threshold=1).manager
    ctx = ReqContext(req_id="r")
    assert m.prepare_store([key(1)], ctx).keys_to_store == [key(1)]
    assert SKIPPED not in m.get_stats().reduce()            # vLLM declares none below 2
    m.on_schedule_end(END)


@pytest.mark.parametrize("bad, message", [
    ({"store_threshold": "two"}, "store_threshold must be an integer"),
    ({"store_threshold": -1}, "store_threshold must be between"),
    ({"store_threshold": 2, "max_tracker_size": 0}, "max_tracker_size must be between"),
    ({"store_threshold": 2.5}, "store_threshold must be an integer"),
])
def test_bad_options_are_refused_with_their_name(daemon, bad, message):
    with pytest.raises(ValueError, match=message):
        Engine(daemon.socket, extra=bad)


def test_scheduler_stores_a_prefix_on_its_second_computation(engine_with):
    e = engine_with(store_threshold=2)
    prom, registry = prometheus(e)
    payloads = capture(e)
    tokens = prompt(3, 5 * BS)
    for rid in ("a", "b", "c"):
        e.add(rid, tokens + [7, int(rid, 16)])
        e.run()
    hits = e.stats.hit_tokens
    # a offers its 5 blocks once (held back), b a second time (stored), c hits them.
    assert (hits["a"], hits["b"], hits["c"]) == (0, 0, 5 * BS)
    for payload in payloads:
        prom.observe(payload, 0)
    assert sample(registry, "vllm:kv_offload_stores_skipped_total") == 5
    assert sample(registry, "vllm:kv_offload_store_bytes_total") == 5 * 1024


def replay(engine: Engine, requests: list[Request]) -> dict[str, int]:
    for i, req in enumerate(requests):
        engine.add(f"r{i}", list(req.tokens), max_tokens=2)
        engine.run(max_steps=2000)
    return dict(engine.stats.hit_tokens)


def shared_prefix_trace() -> list[Request]:
    """Prompts over three shared prefixes, each seen one to four times, some continued."""
    import random

    rng = random.Random(7)
    prefixes = [prompt(10 + i, BS * rng.randint(3, 8)) for i in range(3)]
    out: list[Request] = []
    for i in range(12):
        base = list(rng.choice(prefixes)) if not out or rng.random() < 0.7 else \
            list(rng.choice(out).tokens)
        tail = [rng.randrange(1, 50_000) for _ in range(rng.randint(1, 3 * BS))]
        out.append(Request(session=i, tokens=tuple(base + tail)))
    return out


def vllm_hits(requests: list[Request], **extra: object) -> dict[str, int]:
    """The hits of vLLM's own manager for `requests` (ample capacity unless `extra` says)."""
    baseline = Engine("/nonexistent", num_gpu_blocks=512, extra={
        "spec_name": "ThresholdBaselineSpec", "spec_module_path": __name__,
        "baseline_num_chunks": 4096, **extra})
    try:
        return replay(baseline, requests)
    finally:
        baseline.close()


def kvd_hits(daemon: Daemon, requests: list[Request], **extra: object) -> dict[str, int]:
    engine = Engine(daemon.socket, num_gpu_blocks=512, extra=dict(extra))
    try:
        assert engine.manager.client.wait_available(10)
        return replay(engine, requests)
    finally:
        engine.close()


@pytest.mark.parametrize("threshold, tracker", [(2, 64_000), (3, 64_000), (2, 8)])
def test_kvd_hits_equal_vllms_own_with_a_store_threshold(daemon, threshold, tracker):
    requests = shared_prefix_trace()
    options = {"store_threshold": threshold, "max_tracker_size": tracker}
    expected = vllm_hits(requests, **options)
    assert kvd_hits(daemon, requests, **options) == expected
    assert sum(expected.values()) > 0, "the trace never hits: it proves nothing"
    assert expected != vllm_hits(requests), "the threshold changed nothing: it proves nothing"


@pytest.mark.soak
@pytest.mark.parametrize("seed", range(1, 41))
def test_kvd_hits_equal_vllms_own_with_a_store_threshold_on_random_traces(start_daemon, seed):
    """Random traces, thresholds 2-3, trackers that age counts out, and (odd seeds) a cache
    that evicts, sized as test_differential.py sizes it (capacity plus the reserve, whose
    evicted blocks are not kept: `kvd_keep_evicted` false, so the cache holds `chunks`)."""
    import random

    rng = random.Random(seed)
    options: dict[str, object] = {"store_threshold": rng.choice((2, 3)),
                                  "max_tracker_size": rng.choice((64_000, 16, 64))}
    chunks, policy = 4096, "lru"
    if seed % 2:
        chunks, policy = rng.randint(64, 160), rng.choice(("lru", "arc"))
    requests = random_trace(seed)
    expected = vllm_hits(requests, baseline_num_chunks=chunks, eviction_policy=policy,
                         **options)
    pool = str((chunks + RESERVE) * -(-PAGE // 4096) * 4096)
    daemon = start_daemon("--pool-size", pool, "--extent-size", pool, "--policy", policy)
    got = kvd_hits(daemon, requests, kvd_reserve=RESERVE, kvd_keep_evicted=False, **options)
    assert got == expected, (options, chunks, policy)
