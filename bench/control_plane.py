"""The scheduler thread's cost of offloading, through vLLM 0.33's real scheduler.

The same trace (many multi-turn chat sessions, far more distinct blocks than the cache holds,
so it evicts) is replayed twice in one process: with vLLM's own in-process
CPUOffloadingManager, and with KvdOffloadingSpec against a real `kvd serve`, at the same
pool bytes and eviction policy, each with its defaults (kvd's reserve is sized by the session
itself from the store rate it sees; nothing is tuned for the bench). Every OffloadingManager
method the scheduler calls is timed; a step's manager time is the sum over the calls it made.
Each engine's heap is frozen once it is built, as vLLM's EngineCore does
(vllm.utils.gc_utils.freeze_gc_heap). Per-step figures are over the steps that scheduled
tokens; steps with nothing to schedule (an engine waiting for transfers or messages) are
counted apart, and the total over all steps is reported too.

The grid (`grid`): a model step of 0 (the scheduler thread runs flat out, as with a small
model, a big batch or speculative decoding: nothing ever leaves the GIL to another thread) and
of 5 ms (untimed sleep per step that schedules work: a GPU forward pass), x max_num_seqs 16
and 128 (requests admitted up to that many at once), x LRU and ARC. Per cell and side: manager
time mean and p99, hit tokens, prepare_store calls and how many answered None (vLLM counts an
allocation failure and re-offers), and for kvd the messages it sent per engine step and the
calls to the daemon made on the scheduler thread (blocking waits; the target is none).

Run: `python bench/control_plane.py [--sessions N] [--capacity CHUNKS] [--policy lru|arc]
[--model-step-ms MS] [--max-num-seqs N]`, or `--grid` for every cell.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from daemon import start_daemon  # noqa: E402
from traces import Request, chat  # noqa: E402

if TYPE_CHECKING:
    from tests.vllm.harness import Engine

MAX_TOKENS = 4000
SLOT = 4096            # the harness's chunk (1 KiB), rounded up to the daemon's alignment
# The model's forward pass per step that schedules work, during which the scheduler thread
# waits for the GPU (not timed as manager time): 5 ms is a fast decode step of a small model
# on an H100. 0 is the worst case for a daemon: the scheduler thread never leaves the GIL.
MODEL_STEPS_S = (0.0, 0.005)
MAX_NUM_SEQS = (16, 128)
POLICIES = ("lru", "arc")
MAX_NUM_BATCHED_TOKENS = 2048      # vLLM 0.33's default
MANAGER_METHODS = ("lookup", "prepare_load", "touch", "complete_load", "prepare_store",
                   "complete_store", "on_new_request", "on_request_finished", "take_events",
                   "on_schedule_end", "has_pending_work", "reset_cache", "on_reset_flushed",
                   "get_stats")


class ManagerClock:
    """Time spent inside the manager's methods, per scheduler step.

    The wrapper is as lean as it can be (two clock reads and two additions): its own cost
    lands on both managers alike, once per call, and would otherwise pull the ratio towards
    1 (vLLM's scheduler calls lookup once per chunk, hundreds of thousands of times)."""

    def __init__(self, manager: object) -> None:
        self._last = 0.0
        self.by_method: dict[str, list[float]] = {}     # name -> [seconds, calls]
        self.store_nones = [0]
        for name in MANAGER_METHODS:
            method = getattr(manager, name, None)
            if method is not None:
                setattr(manager, name, self._timed(name, method))

    def _timed(self, name: str, fn):  # noqa: ANN001, ANN202
        tally = self.by_method.setdefault(name, [0.0, 0])
        perf = time.perf_counter
        if name == "take_events":       # a generator: its work runs as the caller takes it

            def events(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                t0 = perf()
                result = list(fn(*args, **kwargs))
                tally[0] += perf() - t0
                tally[1] += 1
                return result
            return events

        if name == "prepare_store":     # also counts the Nones (allocation failures)
            nones = self.store_nones

            def store(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                t0 = perf()
                result = fn(*args, **kwargs)
                tally[0] += perf() - t0
                tally[1] += 1
                if result is None:
                    nones[0] += 1
                return result
            return store

        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t0 = perf()
            result = fn(*args, **kwargs)
            tally[0] += perf() - t0
            tally[1] += 1
            return result
        return wrapper

    def take(self) -> float:
        """Manager time since the last call."""
        total = sum(t for t, _ in self.by_method.values())
        spent, self._last = total - self._last, total
        return spent


def _engine(socket_path: str, extra: dict, max_num_seqs: int) -> Engine:
    """One side's engine, its heap frozen as vLLM's EngineCore freezes it once built
    (vllm.utils.gc_utils.freeze_gc_heap): the harness builds the scheduler without EngineCore.
    Without it, where the cyclic collector's pauses land (inside a manager call or between)
    follows the process's allocation count, and a change anywhere moved one cell's kvd mean by
    half (0.42x <-> 0.61x, the same code started two ways)."""
    from vllm.utils.gc_utils import freeze_gc_heap

    from tests.vllm.harness import Engine

    engine = Engine(socket_path, num_gpu_blocks=max(4096, 128 * max_num_seqs), extra=extra,
                    compute=False, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    gc.unfreeze()           # the engines of earlier cells are gone: collect them first
    freeze_gc_heap()
    return engine


def _replay(engine: Engine, requests: list[Request], model_step_s: float, in_flight: int
            ) -> dict:
    clock = ManagerClock(engine.manager)
    per_step: list[float] = []
    queue = list(requests)
    queue.reverse()
    running: set[str] = set()
    hits = 0
    n = 0
    idle = 0
    total = 0.0
    steps = 0
    t_start = time.perf_counter()
    for _ in range(10_000_000):
        while queue and len(running) < in_flight:
            req = queue.pop()
            rid = f"r{n}"
            n += 1
            engine.add(rid, list(req.tokens[:MAX_TOKENS]), max_tokens=2)
            running.add(rid)
        if not running and not engine.busy():
            break
        clock.take()
        out = engine.step()
        steps += 1
        spent = clock.take()
        if out.total_num_scheduled_tokens and model_step_s:
            time.sleep(model_step_s)
        total += spent
        if out.total_num_scheduled_tokens:
            per_step.append(spent)
        else:
            idle += 1          # nothing scheduled: waiting for transfers or messages
        done = [rid for rid in running if rid not in engine.scheduler.requests]
        for rid in done:
            running.discard(rid)
            hits += engine.stats.hit_tokens.get(rid, 0)
    wall = time.perf_counter() - t_start
    per_step_us = [t * 1e6 for t in per_step]
    per_step_us.sort()
    store_calls = clock.by_method.get("prepare_store", [0.0, 0])[1]
    return {"steps": len(per_step), "engine_steps": steps, "idle_steps": idle,
            "hit_tokens": hits, "wall_seconds": wall,
            "mean": statistics.fmean(per_step_us),
            "median": per_step_us[len(per_step_us) // 2],
            "p99": per_step_us[min(len(per_step_us) - 1, int(len(per_step_us) * 0.99))],
            "total_seconds": total,
            "prepare_store_calls": store_calls, "prepare_store_nones": clock.store_nones[0],
            "by_method": {name: {"seconds": t, "calls": c, "us_per_call": t / c * 1e6}
                          for name, (t, c) in sorted(clock.by_method.items()) if c}}


def _count_blocking_calls(client: Any) -> list[int]:
    """Calls to the daemon made on the calling (scheduler) thread."""
    main = threading.get_ident()
    count = [0]
    for name in ("step", "flush"):
        fn = getattr(client, name, None)
        if fn is None:
            continue

        def wrapped(*args: Any, _fn: Callable[..., Any] = fn, **kwargs: Any) -> Any:
            if threading.get_ident() == main:
                count[0] += 1
            return _fn(*args, **kwargs)
        setattr(client, name, wrapped)
    return count


def _daemon_stats(sock: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "kvd_server", "stats", "--json", "--socket", sock],
                       capture_output=True, text=True, timeout=30)
    return json.loads(r.stdout) if r.returncode == 0 else {}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _messages(session: Any) -> int:
    """Messages the engine's session handed to the daemon so far (batches or ring records)."""
    for name in ("messages_sent", "_seq"):
        value = getattr(session, name, None)
        if isinstance(value, int):
            return value
    return 0


def cell(requests: list[Request], *, capacity: int = 65536, policy: str = "lru",
         model_step_s: float = 0.005, max_num_seqs: int = 16) -> dict:
    """One cell of the grid: vLLM's in-process manager, then kvd, on the same trace."""
    base = _engine("/nonexistent", {"spec_name": "BaselineCPUSpec",
                                    "spec_module_path": "tests.vllm.baseline",
                                    "baseline_num_chunks": capacity, "eviction_policy": policy},
                   max_num_seqs)
    vllm = _replay(base, requests, model_step_s, max_num_seqs)
    base.close()
    with tempfile.TemporaryDirectory(prefix="kvd-cp-", dir="/tmp") as work:
        pool = capacity * SLOT                     # the same pool bytes as vLLM's
        proc, sock = start_daemon(work, str(pool), "--extent-size", str(pool),
                                  "--policy", policy)
        try:
            eng = _engine(sock, {}, max_num_seqs)
            assert eng.manager.client.wait_available(10)
            session = eng.manager.session
            deadline = time.monotonic() + 10
            while not session.available and time.monotonic() < deadline:
                session.has_pending_work()
                time.sleep(0.01)
            blocking = _count_blocking_calls(eng.manager.client)
            sent0 = _messages(session)
            cpu0 = _cpu_seconds(proc.pid)
            kvd = _replay(eng, requests, model_step_s, max_num_seqs)
            kvd["daemon_cpu_seconds"] = _cpu_seconds(proc.pid) - cpu0
            kvd["messages"] = _messages(session) - sent0
            stats = _daemon_stats(sock)
            eng.close()
        finally:
            proc.terminate()
            proc.wait(30)
    counted = stats.get("stats", {}) if stats else {}
    return {
        "policy": policy, "model_step_seconds": model_step_s, "max_num_seqs": max_num_seqs,
        "capacity_chunks": capacity, "pool_bytes": capacity * SLOT,
        "manager_us_per_step": {"kvd": {k: kvd[k] for k in ("mean", "median", "p99")},
                                "vllm": {k: vllm[k] for k in ("mean", "median", "p99")}},
        "ratio": {"mean": kvd["mean"] / vllm["mean"], "p99": kvd["p99"] / vllm["p99"]},
        "blocking_waits": blocking[0],
        "hits": {"kvd": kvd["hit_tokens"], "vllm": vllm["hit_tokens"],
                 "kvd_over_vllm": kvd["hit_tokens"] / max(1, vllm["hit_tokens"])},
        "prepare_store": {side: {"calls": r["prepare_store_calls"],
                                 "nones": r["prepare_store_nones"]}
                          for side, r in (("kvd", kvd), ("vllm", vllm))},
        "messages_per_engine_step": kvd["messages"] / max(1, kvd["engine_steps"]),
        "daemon_cpu_seconds": kvd["daemon_cpu_seconds"],
        "steps": {"kvd": kvd["steps"], "vllm": vllm["steps"]},
        "engine_steps": {"kvd": kvd["engine_steps"], "vllm": vllm["engine_steps"]},
        "idle_steps": {"kvd": kvd["idle_steps"], "vllm": vllm["idle_steps"]},
        "wall_seconds": {"kvd": kvd["wall_seconds"], "vllm": vllm["wall_seconds"]},
        "manager_seconds_total": {"kvd": kvd["total_seconds"], "vllm": vllm["total_seconds"]},
        "by_method": {"kvd": kvd["by_method"], "vllm": vllm["by_method"]},
        "daemon_counted": {k: counted.get(k, 0) for k in
                           ("lookups_total", "hits_total", "misses_total", "evictions_total")},
    }


def cell_met(c: dict) -> dict:
    """The issue's goals for one cell."""
    ps = c["prepare_store"]
    calls = max(1, ps["kvd"]["calls"])
    return {
        "mean_le_0.25x": c["ratio"]["mean"] <= 0.25,
        "p99_le_0.5x": c["ratio"]["p99"] <= 0.5,
        "nones_le_inprocess_plus_0.1pct": ps["kvd"]["nones"] <= ps["vllm"]["nones"]
        + 0.001 * calls,
        "hits_within_1pct": abs(c["hits"]["kvd_over_vllm"] - 1) <= 0.01,
        "zero_blocking_waits": c["blocking_waits"] == 0,
    }


def trace(sessions: int, turns: int) -> list[Request]:
    import traces

    traces.SIZES["bench"] = (sessions, turns)
    return chat("bench")


def _cell_in_process(sessions: int, turns: int, capacity: int, policy: str,
                     model_step_s: float, max_num_seqs: int) -> dict:
    """One cell in a fresh process of its own (both sides in it, as `cell` runs them): a cell
    run after others in one process inherits their heap, and both managers read slower
    there, kvd's cache-bound calls most (5 ms/16 ARC: kvd 415 vs 294 us a step, vLLM 1445
    vs 1212, the same code run fifth in one process vs alone)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--sessions", str(sessions),
           "--turns", str(turns), "--capacity", str(capacity), "--policy", policy,
           "--model-step-ms", repr(model_step_s * 1000), "--max-num-seqs", str(max_num_seqs)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"grid cell {policy} {model_step_s * 1e3:g} ms/{max_num_seqs} "
                           f"failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def grid(sessions: int = 1000, turns: int = 8, capacity: int = 65536,
         cells: list[tuple[float, int, str]] | None = None,
         log: Callable[[str], None] = print) -> list[dict]:
    """Every cell of the grid (model step x max_num_seqs x policy) on one trace, each cell in
    a process of its own (`_cell_in_process`)."""
    requests = len(trace(sessions, turns))
    out = []
    for model_step_s, seqs, policy in cells or [(m, n, p) for m in MODEL_STEPS_S
                                                for n in MAX_NUM_SEQS for p in POLICIES]:
        t0 = time.time()
        c = _cell_in_process(sessions, turns, capacity, policy, model_step_s, seqs)
        c["trace"] = f"chat, {sessions} sessions x up to {turns} turns"
        c["requests"] = requests
        c["met"] = cell_met(c)
        out.append(c)
        log(f"cell model_step={model_step_s * 1e3:g}ms seqs={seqs} {policy}: "
            f"mean {c['ratio']['mean']:.3f}x p99 {c['ratio']['p99']:.3f}x "
            f"hits {c['hits']['kvd_over_vllm']:.4f} nones kvd {c['prepare_store']['kvd']} "
            f"vllm {c['prepare_store']['vllm']} msgs/step {c['messages_per_engine_step']:.2f} "
            f"({time.time() - t0:.0f}s)")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=65536)
    parser.add_argument("--policy", choices=POLICIES, default="lru")
    parser.add_argument("--model-step-ms", type=float, default=5.0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--grid", action="store_true", help="every cell of the grid")
    args = parser.parse_args()
    if args.grid:
        result = grid(args.sessions, args.turns, args.capacity,
                      log=lambda m: print(m, file=sys.stderr, flush=True))
    else:
        result = cell(trace(args.sessions, args.turns), capacity=args.capacity,
                      policy=args.policy, model_step_s=args.model_step_ms / 1000,
                      max_num_seqs=args.max_num_seqs)
        result["met"] = cell_met(result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
