"""Warm restart (restart.warm): how long a daemon takes from exec to serving when it adopts a
full pool, and what a restart costs an engine's hit rate.

`serving`: a warm-restart directory of `pool` GiB is laid out as a daemon leaves it (a sparse
pool file, a record, one namespace's index with every slot a READY block of 64 KiB: 16k blocks
per GiB, the most checks a pool that size can need), then `kvd serve --warm-restart` is started
on it and timed from exec until its health check answers SERVING. A pool larger than this
machine's memory is fine: adoption never touches the pool's pages. The daemon's own
`adopt_seconds` (the checks and the arrays) is reported beside it.

`hits`: the replay trace (bench/traces.py) runs through vLLM 0.33's real scheduler with
KvdOffloadingSpec twice: a first pass fills the cache, then the same requests again (a) with
the daemon untouched, (b) after the daemon is SIGKILLed and started again with warm restart,
(c) after a cold restart. Hit tokens of the second pass compare (b) to (a): the goal is equal.

Run: `python bench/restart.py [--sizes 1,16,64] [--trace chat/small]`; `make bench` runs it
and writes `restart` into bench/results/latest.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc  # noqa: E402
from daemon import start_daemon  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from traces import Request, generate  # noqa: E402

from kvd_proto.paths import grpc_target  # noqa: E402

if TYPE_CHECKING:
    from tests.vllm.harness import Engine

BLOCK = 64 << 10
EXTENT = 64 << 20
KEY_BYTES = 40                  # vLLM's offload keys (36 bytes), as kvd_client.vllm declares
MAX_TOKENS = 4000
SLOT = 4096


def lay_out(directory: Path, pool_bytes: int) -> int:
    """A warm-restart directory as a daemon leaves it: every slot of one namespace READY. The
    number of blocks."""
    from kvd_proto.wire import KvLayout
    from kvd_server.core.namespaces import namespace_id
    from kvd_server.memory.extents import slot_geometry
    from kvd_server.memory.shm_index import ShmIndex
    from kvd_server.restart.state import Manifest, NamespaceRecord, StateDir

    state = StateDir(str(directory))
    state.prepare()
    layout = KvLayout(BLOCK, 1, BLOCK, 16, "bfloat16", KEY_BYTES)
    ns_id = namespace_id("bench-restart", layout, "", "default")
    stride, per_extent = slot_geometry(EXTENT, BLOCK)
    extents = pool_bytes // EXTENT
    capacity = extents * per_extent
    index = ShmIndex(capacity, layout.index_key_width, per_extent, stride, EXTENT,
                     path=str(state.index_path(ns_id)))
    for slot in range(capacity):
        key = slot.to_bytes(8, "big") * 4 + b"\0\0\0\0"
        index.insert(slot, key)
        index.set_ready(slot)
    index.close()
    with open(state.pool_path("default"), "wb") as f:
        f.truncate(pool_bytes)                      # sparse: its pages are never touched
    manifest = Manifest(pool_size=pool_bytes, extent_bytes=EXTENT,
                        tenants={"default": "b" * 16})
    manifest.namespaces[ns_id] = NamespaceRecord.of(ns_id, "bench-restart", layout, "",
                                                    "default")
    state.write(manifest)
    state.release()                         # the daemon under test takes the directory
    return capacity


def _serving(sock: str) -> bool:
    try:
        with grpc.insecure_channel(grpc_target(sock)) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=0.5)
        return answer.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def serving(pool_gib: int) -> dict:
    """Exec to SERVING with `pool_gib` GiB adopted (see the module doc)."""
    work = Path(tempfile.mkdtemp(prefix="kvd-rs-", dir="/tmp"))
    state = Path("/dev/shm") / f"kvd-bench-restart-{os.getpid()}"
    try:
        pool = pool_gib << 30
        blocks = lay_out(state, pool)
        sock = str(work / "kvd.sock")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        log = open(work / "kvd.log", "wb")  # noqa: SIM115
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "kvd_server", "serve", "--socket", sock,
                                 "--pool-size", str(pool), "--extent-size", str(EXTENT),
                                 "--warm-restart", "--restart-dir", str(state)],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while not _serving(sock):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((work / "kvd.log").read_text()[-2000:])
                time.sleep(0.005)
            elapsed = time.perf_counter() - t0
            stats = json.loads(subprocess.run(
                [sys.executable, "-m", "kvd_server", "stats", "--json", "--socket", sock],
                capture_output=True, text=True, env=env, timeout=30).stdout)
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()
        restart = stats["restart"]
        return {"pool_gib": pool_gib, "blocks": blocks, "block_bytes": BLOCK,
                "exec_to_serving_seconds": elapsed,
                "adopt_seconds": restart["adopt_seconds"],
                "blocks_adopted": restart["blocks_adopted"],
                "blocks_dropped": sum(restart["blocks_dropped"].values())}
    finally:
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def _engine(sock: str) -> Engine:
    from tests.vllm.harness import Engine

    return Engine(sock, num_gpu_blocks=512, extra={})


def _pass(engine: Engine, requests: list[Request]) -> int:
    hits = 0
    for i, req in enumerate(requests):
        rid = f"r{i}-{time.monotonic_ns()}"
        engine.add(rid, list(req.tokens[:MAX_TOKENS]), max_tokens=2)
        engine.run(max_steps=2000)
        hits += engine.stats.hit_tokens.get(rid, 0)
    return hits


def _reconnected(engine: Engine) -> None:
    manager = engine.manager
    assert manager.client.wait_available(30), "the engine did not reconnect"
    session = manager.session
    deadline = time.monotonic() + 30
    while not session.available and time.monotonic() < deadline:
        session.has_pending_work()
        session.end_step()
        time.sleep(0.01)


def hits(trace: str, capacity_chunks: int = 600) -> dict:
    """Second-pass hit tokens: untouched, after a warm restart, after a cold one."""
    shape, size = trace.split("/")
    requests = generate(shape, size)
    out: dict = {"trace": trace, "requests": len(requests), "capacity_chunks": capacity_chunks}
    for case in ("untouched", "warm_restart", "cold_restart"):
        work = tempfile.mkdtemp(prefix="kvd-rh-", dir="/tmp")
        state = Path("/dev/shm") / f"kvd-bench-hits-{os.getpid()}"
        args = ("--extent-size", str(capacity_chunks * SLOT), "--warm-restart",
                "--restart-dir", str(state))
        pool = str(capacity_chunks * SLOT)
        proc, sock = start_daemon(work, pool, *args)
        try:
            engine = _engine(sock)
            assert engine.manager.client.wait_available(10)
            first = _pass(engine, requests)
            if case != "untouched":
                proc.kill()
                proc.wait(30)
                extra = ("--cold",) if case == "cold_restart" else ()
                proc, sock = start_daemon(work, pool, *args, *extra)
                _reconnected(engine)
            t0 = time.perf_counter()
            second = _pass(engine, requests)
            out[case] = {"first_pass_hit_tokens": first, "second_pass_hit_tokens": second,
                         "second_pass_seconds": time.perf_counter() - t0}
            engine.close()
        finally:
            proc.terminate()
            proc.wait(30)
            shutil.rmtree(state, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
    base = out["untouched"]["second_pass_hit_tokens"]
    out["warm_over_untouched"] = out["warm_restart"]["second_pass_hit_tokens"] / max(1, base)
    out["cold_over_untouched"] = out["cold_restart"]["second_pass_hit_tokens"] / max(1, base)
    return out


def run(sizes: tuple[int, ...] = (1, 16, 64), trace: str = "chat/small") -> dict:
    timings = [serving(gib) for gib in sizes]
    result = {"serving": timings, "hits": hits(trace)}
    biggest = max(timings, key=lambda t: t["pool_gib"])
    result["met"] = {
        f"serving_le_1s_at_{biggest['pool_gib']}gib": biggest["exec_to_serving_seconds"] <= 1.0,
        # Equal within the spread of the runs themselves: the first passes of the three
        # cases differ by up to ~1% (the engine's timing decides which stores land when).
        "hits_after_warm_restart_equal": result["hits"]["warm_over_untouched"] >= 0.99,
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16,64", help="GiB adopted, comma-separated")
    parser.add_argument("--trace", default="chat/small")
    args = parser.parse_args()
    out = run(tuple(int(s) for s in args.sizes.split(",")), args.trace)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
