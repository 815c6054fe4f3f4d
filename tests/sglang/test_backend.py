"""kvd's SGLang backend against SGLang 0.5.23's own code and a real daemon, in one process.

SGLang's `StorageBackendFactory` creates the backend from the dynamic extra config, SGLang's
host KV pools (MHA and MLA, every layout kvd serves) are the source and destination of the
zero-copy calls, and the flat-page calls read the same bytes. What could not run here: the
GPU<->host copies of SGLang's device pool (CUDA kernels) and the cross-rank agreement of a
TP > 1 run (torch.distributed); kvd's part of both is the host-pool path tested here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvd_client.sglang import KvdHiCacheStorage
from kvd_client.sglang.identity import namespace_of
from kvd_client.sglang.options import OptionError
from tests.sglang.sgl_worker import backend_for, keys_for
from tests.support import sglang_env as E
from tests.support.daemon import spawn_daemon

pytestmark = pytest.mark.multiproc

WAIT_S = 10.0


make = backend_for


def wait_exists(backend: KvdHiCacheStorage, keys: list[str]) -> int:
    deadline = time.monotonic() + WAIT_S
    while (found := backend.batch_exists(keys)) < len(keys) and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def test_factory_loads_the_backend_by_module_path(daemon):
    pool = E.mha_host_pool("page_first")
    backend = make(daemon.socket, pool)
    try:
        assert type(backend) is KvdHiCacheStorage
        assert backend._store is not None and backend._store.client.wait_available(WAIT_S)
    finally:
        backend.close()


@pytest.mark.parametrize("layout", E.PAGE_LAYOUTS)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_v1_round_trip_byte_exact(daemon, layout, mla):
    pool = E.mla_host_pool(layout) if mla else E.mha_host_pool(layout)
    backend = make(daemon.socket, pool, is_mla_model=mla)
    try:
        assert backend._store.client.wait_available(WAIT_S)
        keys = keys_for(f"{layout}/{mla}", 4)
        assert backend.batch_exists(keys) == 0
        written = E.fill_pages(pool, [1, 2, 3, 4], seed=3)
        assert backend.batch_set_v1(keys, E.page_indices(pool, [1, 2, 3, 4])) == [True] * 4
        assert wait_exists(backend, keys) == 4
        # Read into other pages (overwritten first), in another order of pages.
        E.fill_pages(pool, [9, 7, 10, 8], seed=99)
        assert backend.batch_get_v1(keys, E.page_indices(pool, [9, 7, 10, 8])) == [True] * 4
        for page, source in zip([9, 7, 10, 8], [1, 2, 3, 4], strict=True):
            assert E.page_bytes(pool, page * pool.page_size) == written[source]
        # The flat calls read and write the same bytes (SGLang's flat data page).
        flat = pool.get_dummy_flat_data_page()
        assert backend.get(keys[2], flat) is flat
        assert flat.view(torch.uint8).numpy().tobytes() == written[3]
        other = keys_for("flat", 1)
        assert backend.set(other[0], pool.get_data_page(4 * pool.page_size, flat=True))
        assert wait_exists(backend, other) == 1
        assert backend.batch_get_v1(other, E.page_indices(pool, [11])) == [True]
        assert E.page_bytes(pool, 11 * pool.page_size) == written[4]
        assert backend.exists(other[0]) and not backend.exists(keys_for("nothing", 1)[0])
    finally:
        backend.close()


def test_prefix_stops_at_the_first_missing_page(daemon):
    pool = E.mha_host_pool("layer_first")
    backend = make(daemon.socket, pool)
    try:
        assert backend._store.client.wait_available(WAIT_S)
        keys = keys_for("gap", 4)
        E.fill_pages(pool, [1, 2, 3, 4], seed=5)
        assert backend.batch_set_v1([keys[0], keys[1], keys[3]],
                                    E.page_indices(pool, [1, 2, 4])) == [True] * 3
        assert wait_exists(backend, keys[:2]) == 2
        assert backend.batch_exists(keys) == 2
        assert backend.batch_get_v1(keys, E.page_indices(pool, [5, 6, 7, 8])) == \
            [True, True, False, False]
        # Storing pages it holds already answers True (nothing copied twice).
        assert backend.batch_set_v1(keys[:2], E.page_indices(pool, [1, 2])) == [True, True]
    finally:
        backend.close()


def test_bad_calls_answer_false_never_raise(daemon):
    pool = E.mha_host_pool("page_first")
    backend = make(daemon.socket, pool)
    try:
        assert backend._store.client.wait_available(WAIT_S)
        keys = keys_for("bad", 2)
        short = E.page_indices(pool, [1])              # one page's indices for two keys
        assert backend.batch_set_v1(keys, short) == [False, False]
        outside = torch.arange(10_000, 10_000 + 2 * pool.page_size)
        assert backend.batch_set_v1(keys, outside) == [False, False]
        assert backend.batch_get_v1(keys, outside) == [False, False]
        assert backend.batch_set(keys, [torch.zeros(3), torch.zeros(3)]) is False
        assert backend.batch_exists([]) == 0 and backend.batch_get_v1([], short) == []
        assert backend.batch_exists(["not hex at all", "x" * 64]) == 0
    finally:
        backend.close()


def test_no_daemon_costs_nothing(workdir: Path):
    """No daemon: every call answers at once (misses, stores not made), nothing raises."""
    pool = E.mha_host_pool("page_first")
    started = time.monotonic()
    backend = make(str(workdir / "absent.sock"), pool, extra={"kvd_deadline_ms": 200})
    try:
        keys = keys_for("none", 3)
        for _ in range(20):
            assert backend.batch_exists(keys) == 0
            assert backend.batch_get_v1(keys, E.page_indices(pool, [1, 2, 3])) == [False] * 3
            assert backend.batch_set_v1(keys, E.page_indices(pool, [1, 2, 3])) == [False] * 3
        assert time.monotonic() - started < 5
    finally:
        backend.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_a_batch_shared_among_copy_threads_is_byte_exact(daemon, layout):
    """Pages of 2 MiB, 8 a batch (16 MiB: four shares of 4 MiB, the runs cut between
    threads wherever the shares fall), stored and read back with `kvd_copy_threads` 4; and
    the default takes the CPUs this process may use, up to 4."""
    from kvd_client.dataplane.cpu import default_copy_threads

    pool = E.mha_host_pool(layout, layers=16, heads=4, head_dim=64, page_size=128, pages=20)
    backend = make(daemon.socket, pool, extra={"kvd_copy_threads": 4, "kvd_reserve": 16})
    default = make(daemon.socket, pool)
    try:
        assert backend._geometry.copy_threads == 4 and backend._geometry.page_bytes == 2 << 20
        assert default._geometry.copy_threads == default_copy_threads()
        assert backend._store.client.wait_available(WAIT_S)
        keys = keys_for(f"threads/{layout}", 8)
        written = E.fill_pages(pool, list(range(8)), seed=21)
        deadline = time.monotonic() + WAIT_S
        while (done := backend.batch_set_v1(keys, E.page_indices(pool, list(range(8))))) != \
                [True] * 8 and time.monotonic() < deadline:
            time.sleep(0.02)                # the reserve grows to hold the whole batch
        assert done == [True] * 8
        assert wait_exists(backend, keys) == 8
        targets = list(range(19, 11, -1))
        E.fill_pages(pool, targets, seed=77)
        assert backend.batch_get_v1(keys, E.page_indices(pool, targets)) == [True] * 8
        for page, source in zip(targets, range(8), strict=True):
            assert E.page_bytes(pool, page * pool.page_size) == written[source]
    finally:
        backend.close()
        default.close()


def test_flat_batches_round_trip_byte_exact(daemon):
    """SGLang without interface_v1: `batch_set` of flat pages, `batch_get` into flat pages
    (given, and made by the backend), copied as the v1 calls copy."""
    pool = E.mha_host_pool("layer_first")
    backend = make(daemon.socket, pool)
    try:
        assert backend._store.client.wait_available(WAIT_S)
        keys = keys_for("flat-batch", 3)
        written = E.fill_pages(pool, [2, 5, 6], seed=31)
        pages = [pool.get_data_page(p * pool.page_size, flat=True).clone() for p in (2, 5, 6)]
        assert backend.batch_set(keys, pages)
        assert wait_exists(backend, keys) == 3
        given = [pool.get_dummy_flat_data_page().clone() for _ in keys]
        got = backend.batch_get(keys, given)
        assert len(got) == 3 and all(a is b for a, b in zip(got, given, strict=True))
        made = backend.batch_get(keys)
        for page, one, other in zip([2, 5, 6], given, made, strict=True):
            assert one.view(torch.uint8).numpy().tobytes() == written[page]
            assert other is not None and other.numpy().tobytes() == written[page]
    finally:
        backend.close()


def test_options_are_checked_at_start(daemon):
    pool = E.mha_host_pool("page_first")
    for extra, word in (({"kvd_deadline_ms": "soon"}, "kvd_deadline_ms"),
                        ({"kvd_reserve": -1}, "kvd_reserve"),
                        ({"kvd_keep_evicted": "maybe"}, "kvd_keep_evicted"),
                        ({"kvd_copy_threads": 17}, "kvd_copy_threads"),
                        ({"kvd_sokcet": "/x"}, "kvd_sokcet")):
        with pytest.raises(OptionError, match=word):
            make(daemon.socket, pool, extra=extra)


def test_hybrid_pools_are_refused_at_start(daemon):
    pool = E.mha_host_pool("page_first")
    backend = KvdHiCacheStorage(E.storage_config(extra_config={"kvd_socket": daemon.socket}))
    try:
        backend.register_mem_pool_host(pool)
        backend.register_mem_host_pool_v2(pool, "kv")       # the KV pool itself is fine
        backend.register_mem_host_pool_v2(pool, "mamba")
        with pytest.raises(ValueError, match="hybrid"):
            backend.on_host_pools_registered()
    finally:
        backend.close()


def test_namespaces_follow_sglangs_config():
    def ns(**config: object) -> str:
        return namespace_of(E.storage_config(**config), page_size=64, page_bytes=1 << 20,
                            pool_layout="page_first", dtype="bfloat16").salt

    assert ns(tp_rank=0, tp_size=2) != ns(tp_rank=1, tp_size=2)      # MHA ranks apart
    assert ns(tp_rank=0, tp_size=2, is_mla_model=True) == \
        ns(tp_rank=1, tp_size=2, is_mla_model=True)                   # MLA shared
    assert ns(pp_rank=0, pp_size=2) != ns(pp_rank=1, pp_size=2)
    assert ns().startswith("sglang;")                                 # never vLLM's "vllm;"
    assert namespace_of(E.storage_config(), page_size=64, page_bytes=1 << 20,
                        pool_layout="layer_first", dtype="bfloat16").salt != ns()


def test_kvd_stats_of_a_daemon_that_served_only_sglang(daemon):
    pool = E.mha_host_pool("page_first")
    backend = make(daemon.socket, pool)
    try:
        assert backend._store.client.wait_available(WAIT_S)
        keys = keys_for("stats", 3)
        E.fill_pages(pool, [1, 2, 3], seed=1)
        assert backend.batch_set_v1(keys, E.page_indices(pool, [1, 2, 3])) == [True] * 3
        assert wait_exists(backend, keys) == 3
        assert backend.batch_get_v1(keys, E.page_indices(pool, [4, 5, 6])) == [True] * 3
        assert backend.batch_exists(keys_for("absent", 1)) == 0
        page = pool.get_dummy_flat_data_page()
        page_size = page.numel() * page.element_size()
        deadline = time.monotonic() + WAIT_S
        while True:
            backend._store.session.has_pending_work()       # counters reported at once
            r = subprocess.run([sys.executable, "-m", "kvd_server", "stats", "--json",
                                "--socket", daemon.socket], capture_output=True, text=True,
                               timeout=30)
            stats = json.loads(r.stdout)
            counted, moved = stats["stats"], stats["transfers"]
            if (counted["hits_total"] >= 6 and moved["load_bytes_total"] >= 3 * page_size
                    and moved["store_bytes_total"] >= 3 * page_size) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert counted["lookups_total"] >= 7 and counted["hits_total"] >= 6
        assert counted["misses_total"] >= 1 and counted["stores_completed_total"] == 3
        assert moved["load_bytes_total"] == 3 * page_size
        assert moved["store_bytes_total"] == 3 * page_size
    finally:
        backend.close()


def test_a_batch_larger_than_the_reserve_stores_the_prefix_that_fits(workdir: Path):
    """Pages of 128 KiB in an 8 MiB pool (64 slots) and a batch of 128 pages, SGLang's batch
    size: the pages the reserve holds are stored, from the first (SGLang keeps that prefix and
    logs the rest as failed), byte-exact; nothing is refused whole."""
    d = spawn_daemon(workdir, "--pool-size", "8MiB", "--extent-size", "1MiB")
    try:
        pool = E.mha_host_pool("page_first", layers=16, heads=8, head_dim=64, pages=130)
        backend = make(d.socket, pool)
        try:
            assert backend._store.client.wait_available(WAIT_S)
            keys = keys_for("big-batch", 128)
            pages = list(range(1, 129))
            E.fill_pages(pool, pages, seed=8)
            first = backend.batch_set_v1(keys, E.page_indices(pool, pages))
            held = first.count(True)
            assert 0 < held < 128 and first == [True] * held + [False] * (128 - held)
            assert wait_exists(backend, keys[:held]) == held
            got = backend.batch_get_v1(keys[:2], E.page_indices(pool, [0, 129]))
            assert got == [True, True]
            assert E.page_bytes(pool, 0) == E.page_pattern(pool, 1, 8)
            assert E.page_bytes(pool, 129 * pool.page_size) == E.page_pattern(pool, 2, 8)
        finally:
            backend.close()
    finally:
        d.close()
    assert "Traceback" not in d.log(), d.log()
