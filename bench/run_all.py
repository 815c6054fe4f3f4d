"""`make bench`: run every benchmark, write bench/results/latest.json and the plots.

Targets (issue 5) are checked and reported in `targets` of latest.json; a missed target is
reported, never hidden. Pass --quick for a smaller run (100k instead of 1M resident blocks,
smoke-size traces).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
RESULTS = HERE / "results"
# control_plane.run(sessions, turns, capacity chunks): issue 12 asks for >= 1,000 sessions with
# evictions at 65,536 chunks
CONTROL_PLANE_FULL = (1000, 8, 65536)
CONTROL_PLANE_QUICK = (40, 4, 2048)


def machine() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem,
            "python": platform.python_version(), "platform": platform.platform()}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return ""


def main() -> int:
    quick = "--quick" in sys.argv
    t0 = time.time()
    import control_plane
    import daemon
    import dataplane_cpu
    import hitrate
    import replay
    import restart

    print("daemon: throughput, lookup latency, memory ...", flush=True)
    d = daemon.run(quick=quick)
    print("data plane (cpu) ...", flush=True)
    dp = dataplane_cpu.run()
    dp["plan_layers"] = dataplane_cpu.plan_layers()
    print("hit rate: LRU and ARC vs Belady ...", flush=True)
    hr = hitrate.measure("smoke" if quick else "small")
    print("replay through vLLM's scheduler: kvd vs in-process baseline ...", flush=True)
    rp = replay.run("chat", "smoke" if quick else "small")
    print("warm restart: exec to serving with 1, 16 and 64 GiB adopted; hits after a "
          "restart ...", flush=True)
    rs = restart.run((1,) if quick else (1, 16, 64), "chat/smoke" if quick else "chat/small")
    print("sglang: kvd's HiCache storage backend vs memcpy and HiCacheFile ...", flush=True)
    # its own process: bench/sglang.py must not be imported as `sglang` (SGLang's name)
    sg = json.loads(subprocess.run([sys.executable, str(HERE / "sglang.py"), "--no-record"],
                                   stdout=subprocess.PIPE, text=True, check=True).stdout)
    print("control plane: scheduler-thread manager time, kvd vs vLLM in-process, LRU and ARC "
          "...", flush=True)
    size = CONTROL_PLANE_QUICK if quick else CONTROL_PLANE_FULL
    # Every cell of the grid (model step 0 and 5 ms x max_num_seqs 16 and 128 x LRU and ARC),
    # each with the defaults a user gets, kvd and vLLM's in-process manager in the same run.
    cells = control_plane.grid(*size)
    cp = {c["policy"]: c for c in cells            # the old single-cell figures: 5 ms, 16
          if c["model_step_seconds"] == 0.005 and c["max_num_seqs"] == 16}
    lru = cp["lru"]
    rtt = d["stream_rtt_seconds"]
    tput8 = next(t for t in d["throughput"] if t["clients"] == 8)
    chan8 = next(t for t in d["throughput_channel"] if t["clients"] == 8)
    latest = {
        "machine": machine(),
        "commit": commit(),
        "quick": quick,
        "control_plane": {
            # issue 12: the scheduler thread's time inside the offloading manager per step
            # that scheduled work (µs), kvd vs vLLM's CPUOffloadingManager in the same run
            "manager_us_per_step": lru["manager_us_per_step"],
            "ratio": lru["ratio"],
            "blocking_waits": max(c["blocking_waits"] for c in cells),
            "grid": cells,
            "trace": lru["trace"],
            "by_policy": cp,
            "round_trips_per_step": rp["round_trips_per_step"],
            "max_round_trips_in_a_step": rp["max_round_trips_in_a_step"],
            "round_trips_on_idle_steps": rp["round_trips_on_idle_steps"],
            "added_step_seconds": rp["added_step_seconds"],
            "stream_rtt_seconds": rtt,
            "baseline_step_seconds": rp["baseline_step_seconds_median"],
            "kvd_step_seconds": rp["kvd_step_seconds_median"],
            "step_seconds_measure": "scheduler thread: schedule() + update_from_output()",
            "added_whole_step_seconds": rp["added_whole_step_seconds"],
            "kvd_whole_step_seconds": rp["kvd_whole_step_seconds_median"],
            "baseline_whole_step_seconds": rp["baseline_whole_step_seconds_median"],
        },
        "hits": {"kvd": lru["hits"]["kvd"], "vllm": lru["hits"]["vllm"], "unit": "tokens",
                 "trace": lru["trace"], "capacity_chunks": lru["capacity_chunks"],
                 "arc": {"kvd": cp["arc"]["hits"]["kvd"], "vllm": cp["arc"]["hits"]["vllm"]},
                 "replay": {"kvd": rp["hits_kvd_tokens"], "vllm": rp["hits_vllm_tokens"],
                            "trace": rp["trace"], "capacity_chunks": rp["capacity_chunks"]}},
        "daemon": {"steps_per_second": tput8["steps_per_second"],
                   "channel_steps_per_second": chan8["steps_per_second"],
                   "throughput_channel": d["throughput_channel"],
                   "throughput": d["throughput"], "throughput_unary": d["throughput_unary"],
                   "lookup_10k": d["lookup_10k"],
                   "lookup_big": d["lookup_big"]},
        "dataplane": {"cpu_fraction_of_memcpy": dp["fraction_of_memcpy"], "cpu": dp},
        "memory": {"bytes_per_block": d["memory"]["bytes_per_block"], **d["memory"]},
        "hit_rate": hr,
        "restart": rs,
        "sglang": sg,
    }
    p99_growth = d["lookup_big"]["p99_seconds"] / d["lookup_10k"]["p99_seconds"]
    within = [abs(c["hits"]["kvd_over_vllm"] - 1) for c in cells]
    latest["targets"] = {
        "manager_mean_le_0.25x_vllm": all(c["met"]["mean_le_0.25x"] for c in cells),
        "manager_p99_le_0.5x_vllm": all(c["met"]["p99_le_0.5x"] for c in cells),
        "prepare_store_nones_le_vllm_plus_0.1pct": all(
            c["met"]["nones_le_inprocess_plus_0.1pct"] for c in cells),
        "zero_blocking_waits": latest["control_plane"]["blocking_waits"] == 0,
        "hits_within_1pct_vllm": max(within) <= 0.01,
        "memory_le_100_bytes_per_block": d["memory"]["bytes_per_block"] <= 100,
        "added_step_le_1.5x_stream_rtt": rp["added_step_seconds"] <= 1.5 * rtt,
        "round_trips_per_step_le_1": rp["max_round_trips_in_a_step"] <= 1,
        "no_round_trips_on_idle_steps": rp["round_trips_on_idle_steps"] == 0,
        "replay_hits_equal_vllm": rp["hits_kvd_tokens"] == rp["hits_vllm_tokens"],
        "steps_per_second_ge_5000_8_clients": tput8["steps_per_second"] >= 5000,
        # Counted only where the steps did their whole work: 5 records each (a step whose
        # session restarted or whose store or load was skipped cost the daemon less).
        "channel_steps_per_second_ge_5000_8_clients": chan8["steps_per_second"] >= 5000
        and chan8.get("records_per_step", 0) >= 4.9 and not chan8.get("sessions_restarted"),
        "lookup_p99_growth_le_1.2x": p99_growth <= 1.2,
        "lookup_p99_growth": p99_growth,
        "dataplane_cpu_ge_70pct_memcpy": dp["fraction_of_memcpy"] >= 0.7,
        **{f"restart_{name}": met for name, met in rs["met"].items()},
        **{f"sglang_{name}": met for name, met in sg["met"].items()},
    }
    latest["elapsed_seconds"] = time.time() - t0
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "latest.json"
    # Sections written by the benches make bench runs after this one (tiers, cluster_tier)
    # are theirs: kept as they are, so a run of this script alone loses none of them.
    earlier = json.loads(path.read_text()) if path.exists() else {}
    latest = {**{k: v for k, v in earlier.items() if k not in latest}, **latest}
    path.write_text(json.dumps(latest, indent=2) + "\n")
    plots(latest, rp)
    import report

    report.main()
    print(json.dumps(latest["targets"], indent=2))
    print(f"wrote {RESULTS / 'latest.json'} in {latest['elapsed_seconds']:.0f}s")
    return 0


def plots(latest: dict, rp: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib)")
        return
    # step time distribution
    fig, ax = plt.subplots(figsize=(7, 4))
    kvd = [x * 1e3 for x in rp["kvd_step_seconds"]]
    base = [x * 1e3 for x in rp["baseline_step_seconds"]]
    hi = max(statistics.quantiles(kvd + base, n=100)[98], 0.1)
    bins = [hi * i / 60 for i in range(61)]
    ax.hist(base, bins=bins, alpha=0.6, label="vLLM in-process CPU offload")
    ax.hist(kvd, bins=bins, alpha=0.6, label="kvd (daemon)")
    ax.axvline(latest["control_plane"]["stream_rtt_seconds"] * 1e3, color="k", ls="--",
               label="one stream round trip")
    ax.set_xlabel("scheduler step time (ms)")
    ax.set_ylabel("steps")
    ax.set_title(f"Step time, {rp['trace']} through vLLM's scheduler")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "step_overhead.png", dpi=110)
    plt.close(fig)
    # hit rate vs capacity
    hr = latest["hit_rate"]
    fig, axes = plt.subplots(1, len(hr), figsize=(4 * len(hr), 3.6), sharey=True)
    for ax, (shape, data) in zip(axes, hr.items(), strict=True):
        fr = [r["capacity_fraction"] for r in data["rows"]]
        for key, style in (("lru", "o-"), ("arc", "s-"), ("belady", "k--")):
            ax.plot(fr, [r[key] for r in data["rows"]], style, label=key)
        ax.set_title(shape)
        ax.set_xlabel("capacity / distinct blocks")
    axes[0].set_ylabel("hit rate (blocks)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "hit_rate.png", dpi=110)
    plt.close(fig)
    # throughput vs clients
    tp = latest["daemon"]["throughput"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([t["clients"] for t in tp], [t["steps_per_second"] for t in tp], "o-")
    ax.set_xlabel("concurrent engine clients")
    ax.set_ylabel("step calls / s (64 keys each)")
    ax.set_title("Daemon throughput")
    fig.tight_layout()
    fig.savefig(RESULTS / "throughput.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
