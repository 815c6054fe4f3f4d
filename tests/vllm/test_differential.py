"""Differential replay: the same traces through vLLM 0.33's real scheduler with vLLM's own
in-process CPUOffloadingManager and with KvdOffloadingSpec against a real daemon, at the same
capacity and eviction policy. Every request must get exactly the same number of hit tokens.

The traces are bench/traces.py's seeded shapes (multi-turn chat with shared system prompts,
agentic loops re-sending a growing context, long-document QA), sized so the cache evicts, and
random traces of shared prefixes and continued conversations (`KVD_DIFF_SEEDS=1,2,...` picks
the seeds; 4 by default, 36 more were run when this test was written).
"""

from __future__ import annotations

import os

import pytest

from bench.traces import generate

from .harness import Engine
from .random_traces import MAX_TOKENS, PAGE, RESERVE, random_trace

pytestmark = [pytest.mark.vllm]
# (shape, capacity in chunks, blocks per chunk): capacities well below each trace's distinct
# blocks (so both policies evict and differ), but above what its stores in flight need at once:
# below that vLLM's synchronous prepare_store says "cannot store" and retries the next step,
# while kvd answers optimistically and drops a store the daemon refuses (docs/vllm.md).
CASES = [("chat", 60, 1), ("agentic", 80, 1), ("docqa", 120, 1), ("agentic", 40, 2)]


def replay(engine: Engine, requests) -> dict[str, int]:
    refused = [0]
    prepare_store = engine.manager.prepare_store

    def counting(*args, **kwargs):
        out = prepare_store(*args, **kwargs)
        refused[0] += out is None
        return out

    engine.manager.prepare_store = counting
    hits: dict[str, int] = {}
    for i, req in enumerate(requests):
        rid = f"r{i}"
        engine.add(rid, list(req.tokens[:MAX_TOKENS]), max_tokens=2)
        engine.run(max_steps=2000)
        hits[rid] = engine.stats.hit_tokens.get(rid, 0)
    assert refused[0] == 0, "the pool ran full of stores in flight: raise the capacity"
    return hits


def run_both(start_daemon, requests, chunks: int, policy: str, per_chunk: int = 1,
             sliding_window: int | None = None, keep_evicted: bool = False):
    """Replay `requests` with vLLM's own manager, then with kvd at the same capacity:
    (vLLM's hits, kvd's hits, the daemon)."""
    baseline = Engine("/nonexistent", num_gpu_blocks=512, blocks_per_chunk=per_chunk,
                      sliding_window=sliding_window, extra={"spec_name": "BaselineCPUSpec",
                             "spec_module_path": "tests.vllm.baseline",
                             "baseline_num_chunks": chunks, "eviction_policy": policy})
    try:
        expected = replay(baseline, requests)
    finally:
        baseline.close()
    slot = -(-PAGE * per_chunk // 4096) * 4096          # a chunk, rounded up to 4 KiB
    # kvd grants RESERVE slots to the engine in advance (its stores never wait for the
    # daemon): those are on top of the capacity the cache holds, as vLLM's own are not. So
    # that the cache holds exactly `chunks` blocks, the blocks evicted into them are not kept
    # (`kvd_keep_evicted`, on by default, makes them this engine's hits: more than vLLM's at
    # this capacity; test_kept_blocks_only_add_hits says so).
    pool = (chunks + RESERVE) * slot
    daemon = start_daemon("--pool-size", str(pool), "--extent-size", str(pool),
                          "--policy", policy)
    engine = Engine(daemon.socket, num_gpu_blocks=512, blocks_per_chunk=per_chunk,
                    sliding_window=sliding_window,
                    extra={"kvd_reserve": RESERVE, "kvd_keep_evicted": keep_evicted})
    try:
        assert engine.manager.client.wait_available(10)
        got = replay(engine, requests)
        lookups = engine.manager.session._lookups
        if hasattr(lookups, "read_ahead"):       # compiled: its lookahead took part
            assert lookups.read_ahead > 0, "vLLM's ReqContext no longer keeps a request's " \
                "keys in order (_offload_key_positions): kvd's lookahead reads nothing"
    finally:
        engine.close()
    assert sum(expected.values()) > 0, "the trace never hits: it proves nothing"
    return expected, got, daemon


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("shape, chunks, per_chunk", CASES,
                         ids=[f"{s}-{c}chunks-bpc{b}" for s, c, b in CASES])
def test_kvd_hits_equal_vllms_own_offload(start_daemon, shape, chunks, per_chunk, policy):
    expected, got, daemon = run_both(start_daemon, generate(shape, "smoke"), chunks, policy,
                                     per_chunk)
    assert got == expected
    doc = daemon.stats()
    assert doc["stats"]["pins"] == 0 and doc["blocks"]["storing"] == 0
    assert doc["stats"]["evictions_total"] > 0, "the cache never evicted: raise the pressure"


@pytest.mark.parametrize("seed", [int(s) for s in os.environ.get("KVD_DIFF_SEEDS", "1,2,3,4").split(",")])
def test_kvd_hits_equal_vllms_own_offload_on_random_traces(start_daemon, seed):
    import random

    rng = random.Random(seed)
    chunks, policy = rng.randint(64, 160), ("lru", "arc")[seed % 2]
    expected, got, _ = run_both(start_daemon, random_trace(seed), chunks, policy)
    assert got == expected, (chunks, policy)


@pytest.mark.parametrize("shape, chunks", [("chat", 120), ("chat", 300)])
def test_kvd_hits_equal_vllms_own_offload_on_a_hybrid_model(start_daemon, shape, chunks):
    """A full-attention group plus a 64-token sliding-window group: vLLM scans the window
    group from the end, and kvd resolves its keys one by one rather than as a prefix."""
    expected, got, _ = run_both(start_daemon, generate(shape, "smoke"), chunks, "lru",
                                sliding_window=64)
    assert got == expected


@pytest.mark.parametrize("shape, chunks", [("chat", 60), ("agentic", 80)])
def test_kept_blocks_only_add_hits(start_daemon, shape, chunks):
    """With the blocks evicted into the engine's reserve kept (the default), kvd's LRU holds
    those blocks too: with vLLM's own manager at `chunks`, every request hits at least as many
    tokens (LRU's hits only grow with its capacity), and some hit more."""
    expected, got, daemon = run_both(start_daemon, generate(shape, "smoke"), chunks, "lru",
                                     keep_evicted=True)
    assert all(got[rid] >= hits for rid, hits in expected.items()), \
        {rid: (got[rid], hits) for rid, hits in expected.items() if got[rid] < hits}
    assert sum(got.values()) > sum(expected.values())
    restored = sum(ns["blocks_restored_total"] for ns in daemon.stats()["namespaces"])
    assert restored > 0
