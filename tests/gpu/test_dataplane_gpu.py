"""The CUDA data plane, byte-exact across processes through a real daemon (needs a GPU).

A store process per rank copies GPU KV blocks into the slots the daemon granted; the pool is
then compared, byte for byte, with the CPU backend running the same plans (slots and bytes
the plans leave alone must be untouched); a load process per rank copies the slots into other
GPU blocks and compares its whole tensors the same way. Every method of the fallback chain
is forced in turn; page sizes from 16 KiB to 2 MiB; two ranks, two KV groups, SKIP chunks, a
partial first chunk and odd page lengths; and a transfer before the pool is registered.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from kvd_client.dataplane import SKIP, chunks_for_group
from kvd_proto import kvd_pb2
from tests.support.daemon import PY, ROOT, clean_env
from tests.support.engine import Engine, keys_for

from .scenario import Scenario, expected_pool, layout_and_tensors

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU here: the gpu tests run on a GPU machine "
                "(pytest -m gpu tests/gpu)", allow_module_level=True)

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc]

KIB, MIB = 1 << 10, 1 << 20
POOL = ("--pool-size", "512MiB", "--extent-size", "32MiB")
METHODS = ["auto", "kernel", "batch", "loop"]


@pytest.fixture
def gpu_daemon(start_daemon):
    return start_daemon(*POOL)


def run_ranks(action: str, s: Scenario) -> list[dict]:
    procs = [subprocess.Popen([PY, "-m", "tests.gpu.scenario", action, str(rank),
                               s.to_json()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, env=clean_env())
             for rank in range(s.num_ranks)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        lines = stdout.strip().splitlines()
        assert p.returncode == 0 and lines, stderr
        result = json.loads(lines[-1])
        if "unavailable" in result:
            pytest.skip(result["unavailable"])
        assert result["ok"], result.get("error")
        out.append(result)
    return out


def roundtrip(daemon, s: Scenario, skip_chunks: set[int] = frozenset()
              ) -> tuple[list[dict], list[dict]]:
    """Store then load `s` through `daemon`, asserting every byte; the processes' results."""
    layout, _ = layout_and_tensors(s, [0] * len(s.rows))
    engine = Engine(daemon.socket, register=False)
    try:
        engine.reg = engine.call("RegisterSession", kvd_pb2.RegisterSessionRequest(
            engine=kvd_pb2.EngineIdentity(engine_id="gpu-test", engine_kind="pytest"),
            model=f"gpu-{s.seed}", layout=kvd_pb2.KvLayout(
                block_bytes=layout.slot_bytes, num_ranks=s.num_ranks,
                shard_bytes=layout.shard_bytes, tokens_per_block=16, dtype="uint8")))
        n_chunks = sum(chunks_for_group(n, b, s.blocks_per_chunk)
                       for n, b in zip(s.group_sizes, s.block_indices))
        keys = keys_for(f"gpu-{s.seed}", n_chunks)
        grant = engine.call("PrepareStore", kvd_pb2.PrepareStoreRequest(keys=keys, req_id="g"))
        assert list(grant.keys_to_store) == keys, "pool too small for the scenario"
        offsets = list(grant.slot_offsets)
        pool = engine.pool.numpy()
        for off in offsets:                          # the stores must overwrite exactly ...
            pool[off:off + layout.slot_bytes] = 0xAB  # ... what the plans say, nothing else
        s.offsets = [SKIP if i in skip_chunks else off for i, off in enumerate(offsets)]
        before = pool.copy()
        stores = run_ranks("store", s)
        expect = expected_pool(s, before)
        wrong = int((pool != expect).sum())
        assert wrong == 0, f"{wrong} pool bytes differ from the plan"
        engine.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
            keys=keys, success=True, req_id="g", epoch=grant.epoch, slot_offsets=offsets))
        pinned = engine.call("PrepareLoad", kvd_pb2.PrepareLoadRequest(keys=keys, req_id="l"))
        assert list(pinned.slot_offsets) == offsets
        loads = run_ranks("load", s)
        engine.call("CompleteLoad", kvd_pb2.CompleteLoadRequest(keys=keys, req_id="l",
                                                                epoch=pinned.epoch))
    finally:
        engine.close()
    for r in loads:
        assert r["mismatched_blocks"] == 0 and r["wrong_bytes"] == 0, r
        assert r["loaded_blocks"] > 0
    return stores, loads


def assert_method(results: list[dict], method: str) -> None:
    """Each process's transfer ran with the forced method (auto: the chain's best)."""
    for r in results:
        assert r["methods"] == [r["chain"][0] if method == "auto" else method], r


def simple(socket: str, page: int, method: str, seed: int) -> Scenario:
    """One tensor of `page`-byte blocks, half of them moved, in a random order."""
    n = max(16, min(1024, (64 * MIB) // page))
    bpc = 4 if page <= 64 * KIB else 1
    rng = np.random.default_rng(seed)
    ids = rng.permutation(n)
    moved = n // 2
    return Scenario(socket=socket, rows=[page], num_blocks=n, refs=[[[0, page]]],
                    blocks_per_chunk=bpc, num_ranks=1, offsets=[], group_sizes=[moved],
                    block_indices=[1 if bpc > 1 else 0], store_ids=ids[:moved].tolist(),
                    load_ids=ids[moved:].tolist(), method=method, seed=seed)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("page", [16 * KIB, 32 * KIB, 64 * KIB, 2 * MIB])
def test_pages_round_trip_byte_exact(gpu_daemon, page, method):
    stores, loads = roundtrip(gpu_daemon, simple(gpu_daemon.socket, page, method,
                                                 seed=page + len(method)))
    assert_method(stores + loads, method)


@pytest.mark.parametrize("method", METHODS)
def test_ranks_groups_skips_and_odd_pages(gpu_daemon, method):
    """Two ranks (two processes each way), a full-attention group over two tensors and a
    second group over a third, odd bytes per block (4099 of a 4112-byte row, 8191 of 8208),
    two blocks per chunk starting mid-chunk, and a quarter of the chunks SKIP."""
    rng = np.random.default_rng(7)
    n = 96
    ids = rng.permutation(n)
    s = Scenario(socket=gpu_daemon.socket, rows=[4112, 8208, 4112], num_blocks=n,
                 refs=[[[0, 4099], [1, 8191]], [[2, 4112]]], blocks_per_chunk=2,
                 num_ranks=2, offsets=[], group_sizes=[30, 17], block_indices=[1, 4],
                 store_ids=ids[:47].tolist(), load_ids=ids[47:94].tolist(), method=method,
                 seed=11)
    n_chunks = chunks_for_group(30, 1, 2) + chunks_for_group(17, 4, 2)
    stores, loads = roundtrip(gpu_daemon, s, skip_chunks=set(range(0, n_chunks, 4)))
    assert_method(stores + loads, method)


def test_a_transfer_before_the_pool_is_registered_is_exact(gpu_daemon):
    """Registration held back: each process's first transfer takes the pageable path (the
    per-run loop); the same transfer again once the pool is registered takes the chain's
    first method. The bytes are exact either way."""
    s = simple(gpu_daemon.socket, 64 * KIB, "auto", seed=5)
    s.hold_pinning = True
    stores, loads = roundtrip(gpu_daemon, s)
    for r in stores + loads:
        assert r["methods"] == ["loop", r["chain"][0]], r
