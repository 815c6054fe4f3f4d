"""Agent sessions through vLLM 0.33's real scheduler: retention hints and prewarm (docs/agents.md).

The trace: agents in tool loops, each turn re-sending its whole, growing context (a shared
system prompt, its task, every earlier tool result), then pausing for a tool call of 30 to 300
seconds of trace time while other traffic runs (one-off prompts arriving all along); paused
agents' prefixes are about twice the pool, so a pool that keeps them all cannot exist. Trace
time advances a fixed step per engine step (the scheduler itself runs flat out: no model
time), so the replay is deterministic and fast.

Replayed, in one run, with the same pool bytes and the user's defaults (retention.max_share
0.5, LRU):
- vLLM's in-process CPU offloading manager;
- kvd without hints;
- kvd with hints: each agent turn's request carries {"kvd": {"session": "agent-N",
  "retain_s": 600}} in its kv_transfer_params, and the agent's harness releases its session
  when its last turn ends (KvdAdmin.ReleaseAgentSession);
and with a disk tier below the pool, kvd with hints, then with hints and a prewarm of each
agent's session (KvdAdmin.PrewarmAgentSession) a few seconds of trace time before each resumed
turn. Reported: hit tokens (all, and the agents' resumed turns'), the scheduler thread's time
in the offloading manager per step that scheduled work (mean, p99), and lookups answered
HIT_PENDING (a resumed turn waiting for its prefix to come back from the disk).

Run: `python bench/agent_sessions.py [--quick] [--no-record]`; it writes `agent_sessions` into
bench/results/latest.json and its table into bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import control_plane  # noqa: E402  (sets the paths and vLLM's environment)
from control_plane import SLOT, ManagerClock, _engine  # noqa: E402
from daemon import start_daemon  # noqa: E402
from tiers import record  # noqa: E402

RESULTS = HERE / "results"
STEP_TRACE_S = 0.1            # trace time per engine step
PREWARM_AHEAD_S = 5.0         # a prewarm this much trace time before the resumed turn
# The disk-tier runs' GPU step per engine step (untimed), so trace time also passes for the
# daemon's promotions: 5 s of trace time ahead is 250 ms of real time (flat out, ~15 ms).
GPU_STEP_S = 0.005
RETAIN_S = 600                # an agent's hint: longer than any pause (its harness releases)
BS = 16                       # tokens a chunk (the harness's block size)
MAX_NUM_SEQS = 16
VOCAB = 50_000


@dataclass(slots=True)
class Agent:
    name: str
    start: float
    context: list[int]
    turns_left: int
    pauses: list[float]
    results: list[list[int]]
    arrival: float = 0.0
    prewarmed: bool = False


@dataclass(slots=True)
class Trace:
    agents: list[Agent]
    others: list[tuple[float, list[int]]]          # (arrival, prompt): one-off requests
    pool_chunks: int


def make_trace(quick: bool, seed: int = 7) -> Trace:
    """Agents (`n`, `turns` each) and one-off traffic; the pool sized to half the agents'
    paused prefixes."""
    rng = random.Random(f"agents-{seed}")
    n, turns, rate = (10, 3, 1.0) if quick else (32, 5, 1.5)
    systems = [[rng.randrange(VOCAB) for _ in range(480)] for _ in range(2)]
    agents = []
    for i in range(n):
        task = [rng.randrange(VOCAB) for _ in range(rng.randrange(320, 960))]
        results = [[rng.randrange(VOCAB) for _ in range(rng.randrange(160, 640))]
                   for _ in range(turns)]
        pauses = [rng.uniform(30, 300) for _ in range(turns - 1)]
        start = rng.uniform(0, 120 if not quick else 30)
        agents.append(Agent(f"agent-{i}", start, list(rng.choice(systems)) + task, turns,
                            pauses, results, start))
    horizon = max(a.start + sum(a.pauses) for a in agents) + 60
    others, t = [], 0.0
    while t < horizon:
        t += rng.expovariate(rate)
        others.append((t, [rng.randrange(VOCAB) for _ in range(rng.randrange(400, 1600))]))
    # The agents' contexts when paused, on average over their turns: the pool holds half.
    paused = sum(len(a.context) + sum(len(r) for r in a.results[:-1]) * 0.5 for a in agents)
    return Trace(agents, others, int(paused / BS / 2))


@dataclass(slots=True)
class Side:
    hit_tokens: int = 0
    resumed_hit_tokens: int = 0
    resumed_tokens: int = 0
    per_step: list[float] = field(default_factory=list)
    steps: int = 0
    pending_lookups: int = 0
    releases: int = 0
    prewarms: int = 0
    by_method: dict = field(default_factory=dict)


def replay(engine: Any, trace: Trace, *, hints: bool, prewarm: Any = None,
           release: Any = None, model_step_s: float = 0.0) -> Side:
    """Trace time advances STEP_TRACE_S a step; agents' turns arrive when their pause is over
    (a prewarm PREWARM_AHEAD_S before, when given); one-off requests when they are due.
    `model_step_s`: untimed sleep per step (a GPU's forward pass), so that trace time also
    passes for what runs beside the scheduler (the daemon's promotions)."""
    agents = [Agent(a.name, a.start, list(a.context), a.turns_left, list(a.pauses),
                    [list(r) for r in a.results], a.arrival) for a in trace.agents]
    others = list(reversed(trace.others))
    clock = ManagerClock(engine.manager)
    side = Side()
    session = getattr(engine.manager, "session", None)
    pending0 = _pending(session)
    running: dict[str, Agent | None] = {}
    waiting = sorted(agents, key=lambda a: a.arrival)
    n = 0
    t = 0.0
    for _ in range(10_000_000):
        t += STEP_TRACE_S
        if prewarm is not None:
            for a in waiting:
                if not a.prewarmed and a.turns_left < len(a.results) and \
                        a.arrival - PREWARM_AHEAD_S <= t:
                    a.prewarmed = True
                    prewarm(a.name)
                    side.prewarms += 1
        while waiting and waiting[0].arrival <= t:
            a = waiting.pop(0)
            a.context += a.results[len(a.results) - a.turns_left]
            rid = f"{a.name}-t{a.turns_left}"
            params = {"kvd": {"session": a.name, "retain_s": RETAIN_S}} if hints else None
            engine.add(rid, a.context[:4000], max_tokens=2, kv_transfer_params=params)
            running[rid] = a
        while others and others[-1][0] <= t:
            _, tokens = others.pop()
            rid = f"o{n}"
            n += 1
            engine.add(rid, tokens, max_tokens=2)
            running[rid] = None
        if not running and not waiting and not others and not engine.busy():
            break
        clock.take()
        out = engine.step()
        spent = clock.take()
        if model_step_s:
            time.sleep(model_step_s)
        side.steps += 1
        if out.total_num_scheduled_tokens:
            side.per_step.append(spent)
        for rid in [r for r in running if r not in engine.scheduler.requests]:
            a = running.pop(rid)
            hit = engine.stats.hit_tokens.get(rid, 0)
            side.hit_tokens += hit
            if a is None:
                continue
            if a.turns_left < len(a.results):               # a resumed turn
                side.resumed_hit_tokens += hit
                side.resumed_tokens += min(4000, len(a.context))
            a.turns_left -= 1
            if a.turns_left:
                a.arrival = t + a.pauses[len(a.results) - a.turns_left - 1]
                a.prewarmed = False
                waiting.append(a)
                waiting.sort(key=lambda x: x.arrival)
            elif release is not None:
                release(a.name)
                side.releases += 1
    side.pending_lookups = _pending(session) - pending0
    side.by_method = {name: {"calls": c, "us_per_call": t / c * 1e6}
                      for name, (t, c) in sorted(clock.by_method.items()) if c}
    return side


def _pending(session: Any) -> int:
    if session is None:
        return 0
    return session.lookups_total - session.hits_total - session.misses_total


def _summary(side: Side) -> dict:
    us = sorted(x * 1e6 for x in side.per_step)
    return {"hit_tokens": side.hit_tokens, "resumed_hit_tokens": side.resumed_hit_tokens,
            "resumed_tokens": side.resumed_tokens,
            "manager_us_per_step": {"mean": sum(us) / max(1, len(us)),
                                    "p99": us[min(len(us) - 1, int(len(us) * 0.99))] if us
                                    else 0.0},
            "steps": side.steps, "steps_scheduling": len(us),
            "pending_lookups": side.pending_lookups, "releases": side.releases,
            "prewarms": side.prewarms, "by_method": side.by_method}


def _admin(sock: str) -> tuple[Any, Any, Any]:
    """The agent harness's calls: release and prewarm a session (tenant token)."""
    import grpc

    from kvd_proto import kvd_pb2, kvd_pb2_grpc
    from kvd_proto.attach import request_tenant_token
    from kvd_proto.paths import grpc_target
    from kvd_proto.wire import TENANT_TOKEN_METADATA

    channel = grpc.insecure_channel(grpc_target(sock))
    stub = kvd_pb2_grpc.KvdAdminStub(channel)
    md = ((TENANT_TOKEN_METADATA, request_tenant_token(sock, 5.0)[0]),)

    def release(name: str) -> None:
        stub.ReleaseAgentSession(kvd_pb2.ReleaseAgentSessionRequest(session=name),
                                 metadata=md, timeout=5)

    def prewarm(name: str) -> None:
        stub.PrewarmAgentSession(kvd_pb2.PrewarmAgentSessionRequest(session=name),
                                 metadata=md, timeout=5)

    return channel, release, prewarm


def _kvd_side(trace: Trace, *, hints: bool, disk: bool = False, prewarm: bool = False,
              policy: str = "lru", model_step_s: float = 0.0) -> tuple[dict, dict]:
    """kvd with the user's defaults over a pool of the trace's size (and a disk tier)."""
    with tempfile.TemporaryDirectory(prefix="kvd-agents-", dir="/var/tmp") as work:
        saved = dict(os.environ)
        if disk:
            os.environ.update(KVD_TIERS_DISK_PATH=os.path.join(work, "disk"),
                              KVD_TIERS_DISK_SIZE=str(256 << 20))
        try:
            pool = trace.pool_chunks * SLOT
            proc, sock = start_daemon(work, str(pool), "--extent-size", str(pool),
                                      "--policy", policy)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        try:
            if disk:
                _wait_tier(sock)
            eng = _engine(sock, {}, MAX_NUM_SEQS)
            assert eng.manager.client.wait_available(10)
            channel, release, warm = _admin(sock)
            side = replay(eng, trace, hints=hints, release=release if hints else None,
                          prewarm=warm if prewarm else None, model_step_s=model_step_s)
            stats = control_plane._daemon_stats(sock)
            eng.close()
            channel.close()
        finally:
            proc.terminate()
            proc.wait(30)
    return _summary(side), stats.get("retention", {})


def _wait_tier(sock: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        doc = control_plane._daemon_stats(sock)
        if doc.get("tiers") and doc["tiers"][0].get("health") == "ok":
            return
        time.sleep(0.2)
    raise RuntimeError("the disk tier did not open")


def run(quick: bool = False) -> dict:
    t0 = time.time()
    trace = make_trace(quick)
    base = _engine("/nonexistent", {"spec_name": "BaselineCPUSpec",
                                    "spec_module_path": "tests.vllm.baseline",
                                    "baseline_num_chunks": trace.pool_chunks,
                                    "eviction_policy": "lru"}, MAX_NUM_SEQS)
    vllm = _summary(replay(base, trace, hints=False))
    base.close()
    # No hints, hints, no hints again: the two runs without hints say how much the same
    # configuration's step time moves from one run to the next on this machine (the noise).
    plain, _ = _kvd_side(trace, hints=False)
    hinted, retention = _kvd_side(trace, hints=True)
    again, _ = _kvd_side(trace, hints=False)
    disk, _ = _kvd_side(trace, hints=True, disk=True, model_step_s=GPU_STEP_S)
    warm, warm_retention = _kvd_side(trace, hints=True, disk=True, prewarm=True,
                                     model_step_s=GPU_STEP_S)
    ratio = hinted["hit_tokens"] / max(1, plain["hit_tokens"])
    means = [s["manager_us_per_step"]["mean"] for s in (plain, again)]
    step = hinted["manager_us_per_step"]["mean"] / max(1e-9, sum(means) / 2)
    noise = abs(means[0] / max(1e-9, means[1]) - 1)
    result = {
        "trace": {"agents": len(trace.agents), "turns": len(trace.agents[0].results),
                  "one_off_requests": len(trace.others), "pool_chunks": trace.pool_chunks,
                  "pause_s": [30, 300], "step_trace_s": STEP_TRACE_S,
                  "prewarm_ahead_s": PREWARM_AHEAD_S, "policy": "lru",
                  "max_num_seqs": MAX_NUM_SEQS, "model_step_s": 0},
        "vllm": vllm, "kvd_no_hints": plain, "kvd_hints": hinted, "kvd_no_hints_again": again,
        "kvd_hints_disk": disk, "kvd_hints_disk_prewarm": warm,
        "retention": retention, "retention_prewarm": warm_retention,
        "hints_over_no_hints": ratio,
        "hints_over_vllm": hinted["hit_tokens"] / max(1, vllm["hit_tokens"]),
        "step_time_hints_over_no_hints": step,
        "step_time_noise": noise,
        "pending_lookups": {"disk": disk["pending_lookups"],
                            "disk_prewarm": warm["pending_lookups"]},
        "quick": quick, "elapsed_seconds": 0.0,
    }
    result["targets"] = {
        "hints_ge_1.3x_hit_tokens": ratio >= 1.3,
        # Within noise: the two runs without hints differ by `noise`; 10% at least.
        "step_time_within_noise": step <= 1 + max(0.10, noise),
        # A prewarm brings the resumed turns' prefixes back before they arrive: more of them
        # hit (HIT, where without it the turn waited on HIT_PENDING or missed).
        "prewarm_more_resumed_hit_tokens":
            warm["resumed_hit_tokens"] > disk["resumed_hit_tokens"],
        "prewarm_fewer_pending_lookups": warm["pending_lookups"] < max(1, disk["pending_lookups"]),
    }
    result["machine"] = _machine()
    result["commit"] = _commit()
    result["elapsed_seconds"] = time.time() - t0
    return result


def _machine() -> dict:
    return {"cpus": os.cpu_count(), "python": sys.version.split()[0]}


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def table(r: dict) -> str:
    tr = r["trace"]
    rows = [("vLLM in-process", r["vllm"]), ("kvd, no hints", r["kvd_no_hints"]),
            ("kvd, hints", r["kvd_hints"]), ("kvd, no hints (again)", r["kvd_no_hints_again"]),
            ("kvd, hints, disk tier, 5 ms GPU step", r["kvd_hints_disk"]),
            ("kvd, hints + prewarm, disk tier, 5 ms GPU step", r["kvd_hints_disk_prewarm"])]
    lines = [f"Agent trace ({tr['agents']} agents x {tr['turns']} turns, pauses "
             f"{tr['pause_s'][0]}-{tr['pause_s'][1]} s of trace time, {tr['one_off_requests']} "
             f"one-off requests, pool {tr['pool_chunks']} chunks, LRU, flat out), commit "
             f"{r['commit']}:", "",
             "| run | hit tokens | resumed turns' hit tokens | manager us/step mean | p99 "
             "| HIT_PENDING lookups |", "|---|---|---|---|---|---|"]
    for name, s in rows:
        m = s["manager_us_per_step"]
        lines.append(f"| {name} | {s['hit_tokens']} | {s['resumed_hit_tokens']} of "
                     f"{s['resumed_tokens']} | {m['mean']:.0f} | {m['p99']:.0f} | "
                     f"{s['pending_lookups']} |")
    lines += ["", f"Hints: {r['hints_over_no_hints']:.2f}x the hit tokens of kvd without "
                  f"them; scheduler time per step {r['step_time_hints_over_no_hints']:.2f}x "
                  f"(the two runs without hints differ by {r['step_time_noise']:.0%}).",
              "", "| target | |", "|---|---|"]
    lines += [f"| {k} | {'met' if v else '**missed**'} |" for k, v in r["targets"].items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller trace")
    ap.add_argument("--no-record", action="store_true",
                    help="print the results only (latest.json and the README untouched)")
    args, _ = ap.parse_known_args()
    result = run(args.quick)
    if not args.no_record:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"agent_sessions_{result['commit']}.json").write_text(
            json.dumps(result, indent=2) + "\n")
        record(result, "agent_sessions", table(result), "agent-sessions-results")
    print(table(result))
    print(json.dumps(result["targets"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
