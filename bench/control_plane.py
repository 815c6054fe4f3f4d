"""The scheduler thread's cost of offloading, through vLLM 0.33's real scheduler.

The same trace (many multi-turn chat sessions, far more distinct blocks than the cache holds,
so it evicts) is replayed twice in one process: with vLLM's own in-process
CPUOffloadingManager, and with KvdOffloadingSpec against a real `kvd serve`, at the same
capacity and eviction policy. Every OffloadingManager method the scheduler calls is timed; a
step's manager time is the sum over the calls it made. Per-step figures are over the steps
that scheduled tokens; steps with nothing to schedule (an engine waiting for transfers or
messages) are counted apart, and the total over all steps is reported too. Requests run concurrently (up to
16 at once), as a serving engine's do, and each step that schedules work waits MODEL_STEP_S for
the "model" (the GPU forward pass a real engine's scheduler thread waits for), untimed.

Also counted: blocking waits, i.e. calls to the daemon made on the scheduler thread (the
target is none: kvd's answers are local and its messages go out on a background thread).

Run: `python bench/control_plane.py [--sessions N] [--capacity CHUNKS] [--policy lru|arc]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from daemon import start_daemon  # noqa: E402
from traces import Request, chat  # noqa: E402

MAX_TOKENS = 4000
SLOT = 4096            # the harness's chunk (1 KiB), rounded up to the daemon's alignment
IN_FLIGHT = 16         # requests running at once
# The model's forward pass per step, during which the scheduler thread waits for the GPU (not
# timed as manager time). 5 ms is a fast decode step of a small model on an H100; without it
# the CPU harness steps far faster than any real engine, and the daemon (doing, on its own
# core, the policy work vLLM's manager does in-process) is measured against an engine no GPU
# could drive.
MODEL_STEP_S = 0.005
RESERVE = 512          # slots kvd grants the engine ahead (on top of the cache's capacity)
MANAGER_METHODS = ("lookup", "prepare_load", "touch", "complete_load", "prepare_store",
                   "complete_store", "on_new_request", "on_request_finished", "take_events",
                   "on_schedule_end", "has_pending_work", "reset_cache", "on_reset_flushed")


class ManagerClock:
    """Time spent inside the manager's methods, per scheduler step.

    The wrapper is as lean as it can be (two clock reads and two additions): its own cost
    lands on both managers alike, once per call, and would otherwise pull the ratio towards
    1 (vLLM's scheduler calls lookup once per chunk, hundreds of thousands of times)."""

    def __init__(self, manager: object) -> None:
        self._last = 0.0
        self.by_method: dict[str, list[float]] = {}     # name -> [seconds, calls]
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


def _engine(socket_path: str, extra: dict):
    from tests.vllm.harness import Engine

    return Engine(socket_path, num_gpu_blocks=4096, extra=extra, compute=False)


def _replay(engine, requests: list[Request]) -> dict:
    clock = ManagerClock(engine.manager)
    per_step: list[float] = []
    queue = list(requests)
    running: set[str] = set()
    hits = 0
    n = 0
    idle = 0
    total = 0.0
    for _ in range(10_000_000):
        while queue and len(running) < IN_FLIGHT:
            req = queue.pop(0)
            rid = f"r{n}"
            n += 1
            engine.add(rid, list(req.tokens[:MAX_TOKENS]), max_tokens=2)
            running.add(rid)
        if not running and not engine.busy():
            break
        clock.take()
        out = engine.step()
        spent = clock.take()
        if out.total_num_scheduled_tokens:
            time.sleep(MODEL_STEP_S)
        total += spent
        if out.total_num_scheduled_tokens:
            per_step.append(spent)
        else:
            idle += 1          # nothing scheduled: waiting for transfers or messages
        done = [rid for rid in running if rid not in engine.scheduler.requests]
        for rid in done:
            running.discard(rid)
            hits += engine.stats.hit_tokens.get(rid, 0)
    per_step_us = [t * 1e6 for t in per_step]
    per_step_us.sort()
    return {"steps": len(per_step), "idle_steps": idle, "hit_tokens": hits,
            "mean": statistics.fmean(per_step_us),
            "median": per_step_us[len(per_step_us) // 2],
            "p99": per_step_us[min(len(per_step_us) - 1, int(len(per_step_us) * 0.99))],
            "total_seconds": total,
            "by_method": {name: {"seconds": t, "calls": c, "us_per_call": t / c * 1e6}
                          for name, (t, c) in sorted(clock.by_method.items()) if c}}


def _count_blocking_calls(client) -> list[int]:
    """Calls to the daemon made on the calling (scheduler) thread."""
    main = threading.get_ident()
    count = [0]
    for name in ("step", "flush"):
        fn = getattr(client, name)

        def wrapped(*args, _fn=fn, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if threading.get_ident() == main:
                count[0] += 1
            return _fn(*args, **kwargs)
        setattr(client, name, wrapped)
    return count


def run(sessions: int = 1000, turns: int = 8, capacity: int = 65536,
        policy: str = "lru") -> dict:
    import traces

    traces.SIZES["bench"] = (sessions, turns)
    requests = chat("bench")
    base = _engine("/nonexistent", {"spec_name": "BaselineCPUSpec",
                                    "spec_module_path": "tests.vllm.baseline",
                                    "baseline_num_chunks": capacity, "eviction_policy": policy})
    vllm = _replay(base, requests)
    base.close()
    with tempfile.TemporaryDirectory(prefix="kvd-cp-", dir="/tmp") as work:
        pool = (capacity + RESERVE) * SLOT
        proc, sock = start_daemon(work, str(pool), "--extent-size", str(pool),
                                  "--policy", policy)
        try:
            eng = _engine(sock, {"kvd_reserve": RESERVE})
            assert eng.manager.client.wait_available(10)
            blocking = _count_blocking_calls(eng.manager.client)
            kvd = _replay(eng, requests)
            stats = json.loads(
                __import__("subprocess").run(
                    [sys.executable, "-m", "kvd_server", "stats", "--json", "--socket", sock],
                    capture_output=True, text=True, timeout=30).stdout)
            eng.close()
        finally:
            proc.terminate()
            proc.wait(30)
    evictions = stats["stats"]["evictions_total"] if stats else 0
    return {
        "trace": f"chat, {sessions} sessions x up to {turns} turns", "requests": len(requests),
        "capacity_chunks": capacity, "policy": policy, "in_flight": IN_FLIGHT,
        "model_step_seconds": MODEL_STEP_S,
        "manager_us_per_step": {"kvd": {k: kvd[k] for k in ("mean", "median", "p99")},
                                "vllm": {k: vllm[k] for k in ("mean", "median", "p99")}},
        "ratio": {"mean": kvd["mean"] / vllm["mean"], "p99": kvd["p99"] / vllm["p99"]},
        "blocking_waits": blocking[0],
        "hits": {"kvd": kvd["hit_tokens"], "vllm": vllm["hit_tokens"],
                 "kvd_over_vllm": kvd["hit_tokens"] / max(1, vllm["hit_tokens"])},
        "steps": {"kvd": kvd["steps"], "vllm": vllm["steps"]},
        "idle_steps": {"kvd": kvd["idle_steps"], "vllm": vllm["idle_steps"]},
        "manager_seconds_total": {"kvd": kvd["total_seconds"], "vllm": vllm["total_seconds"]},
        "by_method": {"kvd": kvd["by_method"], "vllm": vllm["by_method"]},
        "evictions_kvd": evictions,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=65536)
    parser.add_argument("--policy", choices=("lru", "arc"), default="lru")
    args = parser.parse_args()
    print(json.dumps(run(args.sessions, args.turns, args.capacity, args.policy), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
