"""KvdOffloadingSpec driven by vLLM 0.33's real Scheduler against a real `kvd serve`.

Mirrors the behaviours vLLM's own offloading-connector tests check (store then hit, loads,
preemption, abort, reset), plus what a shared daemon adds (two engines sharing blocks, the
daemon dying under a running engine) and the scheduler-thread budget (<= 1 round trip per step,
none on steps with nothing to send).
"""

from __future__ import annotations

import time

import pytest
import torch
from vllm.v1.request import RequestStatus

from .prompts import BS, assert_loaded_bytes, prompt

pytestmark = [pytest.mark.vllm]


def write_then_read(engines, seed: int, n_tokens: int, **engine_kwargs):
    """One engine computes and offloads a prompt; a fresh engine reads it back.

    The reader poisons (-1) everything it computes itself, so its hit blocks can only hold the
    writer's bytes if they came from kvd. Returns (reader, tokens, hit blocks).
    """
    writer = engines(**engine_kwargs)
    tokens = prompt(seed, n_tokens)
    writer.add("w", tokens)
    writer.run()
    reader = engines(**engine_kwargs)
    reader.poison = True
    reader.add("r", tokens + [9])
    reader.run()
    return reader, tokens, reader.stats.hit_tokens["r"] // BS


def test_repeated_prefix_hits_on_second_request(engines):
    e = engines()
    tokens = prompt(1, 5 * BS + 3)
    e.add("a", tokens)
    e.run()
    assert e.stats.hit_tokens["a"] == 0
    e.add("b", tokens + [1, 2, 3])
    e.run()
    assert e.stats.hit_tokens["b"] == 5 * BS


def test_loaded_bytes_equal_stored_bytes_across_engines(engines, daemon):
    reader, tokens, hit_blocks = write_then_read(engines, 2, 6 * BS)
    assert hit_blocks >= 5, reader.stats.hit_tokens
    assert_loaded_bytes(reader, tokens, hit_blocks)
    doc = daemon.stats()
    assert doc["stats"]["pins"] == 0 and doc["blocks"]["storing"] == 0


def test_round_trips_per_step(engines):
    e = engines()
    tokens = prompt(3, 4 * BS)
    e.add("a", tokens)
    e.run()
    e.add("b", tokens)
    e.run()
    assert max(e.stats.round_trips) <= 1
    idle_before = len(e.stats.round_trips)
    for _ in range(5):           # nothing to schedule, nothing to send
        e.step()
    assert e.stats.round_trips[idle_before:] == [0] * 5


def test_blocks_per_chunk_greater_than_one(engines):
    reader, tokens, hit_blocks = write_then_read(engines, 4, 8 * BS + 5, blocks_per_chunk=2)
    assert hit_blocks >= 6
    assert_loaded_bytes(reader, tokens, hit_blocks)


def test_preemption_leaves_no_pins_or_pending_stores(engines, daemon):
    e = engines(num_gpu_blocks=12)
    e.add("a", prompt(5, 5 * BS), max_tokens=40)
    e.add("b", prompt(6, 5 * BS), max_tokens=40)
    e.run(max_steps=400)
    doc = daemon.stats()
    assert doc["stats"]["pins"] == 0 and doc["blocks"]["storing"] == 0
    assert doc["namespaces"][0]["stores_completed_total"] > 0


def test_abort_while_loading(engines, daemon):
    writer = engines()
    tokens = prompt(7, 6 * BS)
    writer.add("w", tokens)
    writer.run()
    e = engines()
    e.add("x", tokens)
    for _ in range(3):           # lookups resolve, the load starts
        e.step()
    e.scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    e.run()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and daemon.stats()["stats"]["pins"]:
        time.sleep(0.05)
    assert daemon.stats()["stats"]["pins"] == 0


def test_reset_drops_blocks_and_later_requests_miss(engines, daemon):
    e = engines()
    tokens = prompt(8, 4 * BS)
    e.add("a", tokens)
    e.run()
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    for _ in range(3):
        e.step()
    e.add("b", tokens)
    e.run()
    assert e.stats.hit_tokens["b"] == 0
    doc = daemon.stats()
    assert doc["stats"]["resets_total"] >= 1 and doc["blocks"]["zombie"] == 0
    e.add("c", tokens)           # stored again after the reset: hits
    e.run()
    assert e.stats.hit_tokens["c"] == 4 * BS - BS or e.stats.hit_tokens["c"] >= 3 * BS


def test_two_engines_share_one_daemon(engines):
    a, b = engines(), engines()
    tokens = prompt(9, 7 * BS)
    a.add("a1", tokens)
    a.run()
    b.add("b1", tokens + [5])
    b.run()
    assert b.stats.hit_tokens["b1"] == 7 * BS
    assert a.manager.client.namespace_id == b.manager.client.namespace_id


def test_daemon_killed_mid_run_then_restarted(start_daemon, workdir):
    from .harness import Engine

    d = start_daemon("--pool-size", "64MiB", "--extent-size", "4MiB")
    e = Engine(d.socket)
    try:
        assert e.manager.client.wait_available(10)
        e.add("a", prompt(10, 4 * BS))
        e.run()
        d.proc.kill()
        d.proc.wait(10)
        # the engine keeps scheduling: no exception, requests finish without offload
        t0 = time.monotonic()
        e.add("b", prompt(11, 4 * BS), max_tokens=3)
        e.run()
        assert time.monotonic() - t0 < 10
        assert not e.manager.client.available
        d2 = start_daemon("--pool-size", "64MiB", "--extent-size", "4MiB", socket=d.socket)
        assert e.manager.client.wait_available(5), "engine did not reconnect"
        tokens = prompt(12, 4 * BS)
        e.add("c", tokens)
        e.run()
        e.add("d", tokens)
        e.run()
        assert e.stats.hit_tokens["d"] >= 3 * BS
        assert d2.stats()["sessions"] >= 1
    finally:
        e.close()


def test_hybrid_model_full_and_sliding_window_groups(engines):
    """A hybrid model (a full-attention group and a sliding-window group over one allocation,
    as Gemma or gpt-oss have): each group's chunks go to their own slots, the worker copies
    both, and the reader gets exactly the writer's bytes in both groups."""
    window = 4 * BS
    reader, tokens, hit_blocks = write_then_read(engines, 31, 20 * BS, sliding_window=window)
    worker = reader.worker.connector_worker.worker   # a worker refusing the layout raises
    assert worker.layout.num_ranks == 1 and len(worker.layout.refs_per_group) == 2, \
        "the worker refused the hybrid layout"
    assert hit_blocks >= 16
    assert_loaded_bytes(reader, tokens, hit_blocks)
    # The sliding-window group loads only the blocks inside the window before the hit.
    ids = reader.window_blocks_seen["r"]
    checked = 0
    for i in range(max(0, hit_blocks - window // BS), hit_blocks):
        if ids[i] == 0:
            continue
        expected = reader.pattern(tokens[: (i + 1) * BS], i, reader.kv_window[0].shape, group=1)
        assert torch.equal(reader.kv_window[ids[i]], expected), f"window block {i}"
        checked += 1
    assert checked > 0, "no sliding-window block was loaded"


def test_worker_refuses_a_layout_its_slots_cannot_hold(daemon):
    """Pages larger than the slots vLLM sized must stop the engine, not skip loads."""
    from types import SimpleNamespace

    from kvd_client.vllm.worker import KvdOffloadingWorker

    tensor = torch.zeros(8, 2048, dtype=torch.uint8)
    caches = SimpleNamespace(  # the two fields of vLLM's CanonicalKVCaches the worker reads
        tensors=[SimpleNamespace(tensor=tensor, page_size_bytes=2048)],
        group_data_refs=[[SimpleNamespace(tensor_idx=0, page_size_bytes=2048)]])
    with pytest.raises(ValueError, match="cannot offload this model's KV cache"):
        KvdOffloadingWorker(daemon.socket, caches, blocks_per_chunk=1, rank=0, world_size=1,
                            expected_shard_bytes=1024)


def assert_ranks_loaded(reader, tokens, hit_blocks: int) -> None:
    ids = reader.blocks_seen["r"]
    for r in reader.ranks:
        for i in range(hit_blocks):
            assert torch.equal(r.kv[ids[i]], reader.expected_block(tokens, i, r.rank)), \
                f"rank {r.rank} block {i}"


def test_sharded_ranks_each_get_their_own_shard_back(engines):
    """Tensor parallelism over 2 workers: a slot holds both ranks' shards; each rank loads
    exactly its own."""
    reader, tokens, hit_blocks = write_then_read(engines, 41, 6 * BS, world_size=2)
    assert hit_blocks >= 5
    assert reader.offload_worker(1).layout.num_ranks == 2
    assert_ranks_loaded(reader, tokens, hit_blocks)


def test_mla_kv_is_stored_once_by_rank_0_and_read_by_every_rank(engines, daemon):
    """MLA under TP 2: every rank holds the same latent KV. A slot holds one copy, only rank 0
    writes it (vLLM hands no store to rank 1), both ranks load it, and the namespace says
    'replicated', so such an engine never shares slots with a sharded one."""
    writer = engines(mla=True, world_size=2)
    stores = [0, 0]
    for rank in (0, 1):
        worker = writer.offload_worker(rank)
        original = worker.submit_store

        def spy(*args, _rank=rank, _original=original, **kwargs):
            stores[_rank] += 1
            return _original(*args, **kwargs)

        worker.submit_store = spy
    tokens = prompt(42, 6 * BS)
    writer.add("w", tokens)
    writer.run()
    assert stores[0] > 0 and stores[1] == 0, stores

    reader = engines(mla=True, world_size=2)
    reader.poison = True
    reader.add("r", tokens + [9])
    reader.run()
    hit_blocks = reader.stats.hit_tokens["r"] // BS
    assert hit_blocks >= 5
    assert_ranks_loaded(reader, tokens, hit_blocks)

    page = BS * 8 * 4                      # block_size x head_size x float32, no V
    layout = writer.manager.client.layout
    assert (layout.num_ranks, layout.shard_bytes, layout.block_bytes) == (1, page, page)
    assert writer.manager.client.salt.endswith(";replicated")
    for rank in (0, 1):
        assert writer.offload_worker(rank).layout.slot_bytes == page
    single = engines(mla=True)             # TP 1: the same bytes, but not replicated
    assert single.manager.client.layout.block_bytes == page
    assert single.manager.client.namespace_id != writer.manager.client.namespace_id
    assert len({ns["id"] for ns in daemon.stats()["namespaces"]}) == 2


def test_workers_report_their_transfers_to_the_daemon(engines, daemon):
    """The workers have no session; their transfer sizes and times reach the daemon through
    the attach socket's report role, so kvd_transfer_* move with vLLM."""
    writer = engines()
    tokens = prompt(43, 4 * BS)
    writer.add("w", tokens)
    writer.run()
    reader = engines()
    reader.add("r", tokens + [9])
    reader.run()
    hit_blocks = reader.stats.hit_tokens["r"] // BS
    assert hit_blocks >= 3
    for engine in (writer, reader):
        engine.offload_worker().reporter.flush()   # what its thread does once a second
    page = BS * 8 * 4 * 2                          # K and V of one block
    t = daemon.stats()["transfers"]
    assert t["store_bytes_total"] >= 4 * page and t["load_bytes_total"] >= hit_blocks * page
    assert t["store_seconds_total"] > 0 and t["load_seconds_total"] > 0
