"""Write bench/README.md's results table from results/latest.json (run by run_all.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _channel8(d: dict) -> dict:
    """The 8-engine channel run of latest.json's daemon section ({} when absent)."""
    runs = d["daemon"].get("throughput_channel") or []
    return next((t for t in runs if t.get("clients") == 8), {})


def table(d: dict) -> str:
    cp, t, m = d["control_plane"], d["targets"], d["machine"]
    rows = []
    cells = cp.get("grid", [])
    if cells:
        worst_mean = max(c["ratio"]["mean"] for c in cells)
        worst_p99 = max(c["ratio"]["p99"] for c in cells)
        rows += [
            (f"manager time per step, mean, kvd / vLLM in-process, worst of {len(cells)} "
             "cells (grid below)", f"{worst_mean:.2f}x", "<= 0.25x",
             t["manager_mean_le_0.25x_vllm"]),
            ("manager time per step, p99, worst cell", f"{worst_p99:.2f}x", "<= 0.5x",
             t["manager_p99_le_0.5x_vllm"]),
            ("prepare_store answered None, every cell",
             ", ".join(str(c["prepare_store"]["kvd"]["nones"]) for c in cells),
             "<= vLLM's + 0.1% of calls", t.get("prepare_store_nones_le_vllm_plus_0.1pct")),
            ("blocking waits on the scheduler thread", str(cp["blocking_waits"]), "0",
             t["zero_blocking_waits"]),
            ("hit tokens kvd / vLLM, worst cell",
             f"{min(c['hits']['kvd_over_vllm'] for c in cells):.4f}", "within 1%",
             t["hits_within_1pct_vllm"]),
        ]
    rows += [
        ("kvd added time per step (scheduler thread)",
         f"{cp['added_step_seconds'] * 1e3:.2f} ms",
         f"<= 1.5 x stream RTT ({1.5 * cp['stream_rtt_seconds'] * 1e3:.2f} ms)",
         t["added_step_le_1.5x_stream_rtt"]),
        ("round trips per step (mean / max)",
         f"{cp['round_trips_per_step']:.2f} / {cp['max_round_trips_in_a_step']}", "<= 1",
         t["round_trips_per_step_le_1"]),
        ("round trips on idle steps", str(cp["round_trips_on_idle_steps"]), "0",
         t["no_round_trips_on_idle_steps"]),
        ("replay hit tokens kvd / vLLM (same capacity, LRU)",
         f"{d['hits']['replay']['kvd']} / {d['hits']['replay']['vllm']}", "equal",
         t["replay_hits_equal_vllm"]),
        ("step calls/s, 8 clients x 64 keys (gRPC StepStream)",
         f"{d['daemon']['steps_per_second']:.0f}", ">= 5000",
         t["steps_per_second_ge_5000_8_clients"]),
        *([("engine steps/s, 8 fast-path engines x 64 keys (channel; records a step, "
            "5 when each did its whole work)",
            f"{d['daemon']['channel_steps_per_second']:.0f} ("
            f"{_channel8(d).get('records_per_step', 0):.1f} records a step)", ">= 5000",
            t["channel_steps_per_second_ge_5000_8_clients"])]
          if "channel_steps_per_second" in d["daemon"] else []),
        ("lookup p99 growth 10k -> 1M blocks", f"{t['lookup_p99_growth']:.2f}x", "<= 1.2x",
         t["lookup_p99_growth_le_1.2x"]),
        ("CPU data plane vs memcpy (32 KiB fragments)",
         f"{d['dataplane']['cpu_fraction_of_memcpy'] * 100:.0f}%", ">= 70%",
         t["dataplane_cpu_ge_70pct_memcpy"]),
        ("daemon memory per resident block (1M)", f"{d['memory']['bytes_per_block']:.0f} B",
         "<= 100 B", t["memory_le_100_bytes_per_block"]),
    ]
    rs = d.get("restart")
    if rs:
        big = max(rs["serving"], key=lambda x: x["pool_gib"])
        hits = rs["hits"]
        rows += [
            (f"warm restart{' (at ' + rs['commit'] + ')' if rs.get('commit') else ''}: "
             f"exec to serving, {big['pool_gib']} GiB adopted "
             f"({big['blocks']} blocks; " + ", ".join(
                 f"{x['pool_gib']} GiB {x['exec_to_serving_seconds']:.2f} s"
                 for x in rs["serving"]) + ")",
             f"{big['exec_to_serving_seconds']:.2f} s", "<= 1 s",
             big["exec_to_serving_seconds"] <= 1.0),
            (f"hit tokens after a warm restart / untouched ({hits['trace']}, second pass; "
             f"cold restart {hits['cold_over_untouched']:.3f})",
             f"{hits['warm_over_untouched']:.3f}", "equal (within the runs' 1% spread)",
             hits["warm_over_untouched"] >= 0.99),
        ]
    head = (f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / 2**30:.0f} GiB, "
            f"Python {m['python']}. Commit: `{d['commit']}`.\n\n"
            "| target | measured | target | |\n|---|---|---|---|\n")
    body = "\n".join(f"| {a} | {b} | {c} | {'met' if ok else '**missed**'} |"
                     for a, b, c, ok in rows) + "\n"
    extra = []
    if "added_whole_step_seconds" in cp:
        extra.append(f"- Scheduler thread per step: kvd {cp['kvd_step_seconds'] * 1e3:.2f} ms, "
                     f"baseline {cp['baseline_step_seconds'] * 1e3:.2f} ms. Whole harness step "
                     f"(scheduler + worker copies + fake model): kvd "
                     f"{cp['kvd_whole_step_seconds'] * 1e3:.2f} ms, baseline "
                     f"{cp['baseline_whole_step_seconds'] * 1e3:.2f} ms (added "
                     f"{cp['added_whole_step_seconds'] * 1e3:.2f} ms; kvd's CPU worker really "
                     "copies, the baseline's cannot on CPU).")
    layers = d["dataplane"].get("cpu", {}).get("plan_layers")
    if layers:
        extra.append(f"- Planner alone, one transfer on a {layers[0]['layers']}-layer layout "
                     "(a worker plans every job on the engine's thread): " + ", ".join(
                         f"{x['blocks']} blocks {x['plan_us']:.0f} us" for x in layers) + ".")
    unary = d["daemon"].get("throughput_unary")
    if unary:
        extra.append(f"- 8 clients with unary `Step` calls instead of `StepStream`: "
                     f"{unary[0]['steps_per_second']:.0f} step calls/s.")
    grid = ("\n" + grid_table(cells, cp.get("grid_commit", "")) if cells else "")
    return head + body + grid + ("\n" + "\n".join(extra) + "\n" if extra else "")


def grid_table(cells: list[dict], commit: str = "") -> str:
    """The control plane's grid: one row per cell, kvd against vLLM's in-process manager
    (`commit`: where the grid was measured, when not the rest of the run's)."""
    at = f" at `{commit}`" if commit else ""
    lines = [f"Control plane grid{at} ({cells[0]['trace']}, {cells[0]['capacity_chunks']} "
             "chunks of pool, defaults only): manager time per step that schedules work.", "",
             "| model step | max_num_seqs | policy | mean kvd / vLLM µs | p99 kvd / vLLM µs "
             "| hit tokens kvd / vLLM | prepare_store Nones kvd / vLLM (calls) "
             "| messages / engine step | blocking waits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        m, ps = c["manager_us_per_step"], c["prepare_store"]
        lines.append(
            f"| {c['model_step_seconds'] * 1e3:g} ms | {c['max_num_seqs']} | {c['policy']} "
            f"| {m['kvd']['mean']:.0f} / {m['vllm']['mean']:.0f} "
            f"(**{c['ratio']['mean']:.2f}x**) "
            f"| {m['kvd']['p99']:.0f} / {m['vllm']['p99']:.0f} ({c['ratio']['p99']:.2f}x) "
            f"| {c['hits']['kvd_over_vllm']:.4f} "
            f"| {ps['kvd']['nones']} / {ps['vllm']['nones']} ({ps['kvd']['calls']}) "
            f"| {c['messages_per_engine_step']:.1f} | {c['blocking_waits']} |")
    return "\n".join(lines) + "\n"


def summary(d: dict) -> str:
    """The project README's short table: the scheduler thread's cost, kvd vs vLLM."""
    cp, m = d["control_plane"], d["machine"]
    cells = cp.get("grid")
    if not cells:
        return ""
    return (grid_table(cells) + f"\nMachine: {m['cpu']}, {m['cores']} cores; commit "
            f"`{cp.get('grid_commit') or d['commit']}`.\n")


def gpu_table(g: dict) -> str:
    """bench/README.md's GPU section, from results/gpu.json (dataplane_cuda.py's output):
    per page size, the chosen method (auto) and each forced one, against the pinned copy."""
    m, ref = g["machine"], g["pinned_copy"]
    lines = [f"{m['gpu']}, driver {m['driver']}, torch {m['torch']}, cupy {m['cupy']}; "
             f"one pinned copy of the same 2 GiB: store {ref['store_gbps']:.1f} GB/s, "
             f"load {ref['load_gbps']:.1f} GB/s.", "",
             "| page | method | store GB/s (of pinned) | load GB/s (of pinned) "
             "| CPU submit ms / 4 GiB (store, load) | plan ms / 4 GiB |",
             "|---|---|---|---|---|---|"]
    for r in g["pages"]:
        if "store" not in r:
            lines.append(f"| {r['page_bytes'] >> 10} KiB | {r['method']} | unavailable: "
                         f"{r.get('unavailable', '')} | | | |")
            continue
        st, ld = r["store"], r["load"]
        lines.append(
            f"| {r['page_bytes'] >> 10} KiB | {r['method']} "
            f"| {st['gbps']:.1f} ({st['fraction_of_pinned_copy']:.0%}) "
            f"| {ld['gbps']:.1f} ({ld['fraction_of_pinned_copy']:.0%}) "
            f"| {st['submit_ms_per_4gib']:.1f}, {ld['submit_ms_per_4gib']:.1f} "
            f"| {st['plan_ms_per_4gib']:.1f}, {ld['plan_ms_per_4gib']:.1f} |")
    ready = g.get("ready")
    if ready:
        lines += ["", f"A worker on a {ready['pool_gib']} GiB pool: ready to copy after "
                  f"{ready['ready_seconds'] * 1e3:.1f} ms; its first transfer (before "
                  f"registration, method {', '.join(ready['first_transfer_methods'])}) done "
                  f"after {ready['first_transfer_done_seconds'] * 1e3:.0f} ms; registration "
                  f"in the background {ready['registration_seconds_per_gib'] * 1e3:.0f} ms/GiB "
                  f"({ready['registered_gib']:.0f} GiB in {ready['registration_seconds']:.1f} s)."]
    lines += ["", "| target | |", "|---|---|"]
    lines += [f"| {name} | {'met' if ok else '**missed**'} |"
              for name, ok in g["targets"].items() if ok is not None]
    return "\n".join(lines) + "\n"


def _fill(path: Path, text: str, marker: str = "results") -> None:
    old = path.read_text()
    new = re.sub(rf"(<!-- {marker} -->\n).*?(<!-- /{marker} -->)",
                 lambda mm: mm.group(1) + text + mm.group(2), old, flags=re.S)
    path.write_text(new)


def main() -> None:
    d = json.loads((HERE / "results" / "latest.json").read_text())
    _fill(HERE / "README.md", table(d))
    short = summary(d)
    if short:
        _fill(HERE.parent / "README.md", short)
    gpu = HERE / "results" / "gpu.json"
    if gpu.exists():
        _fill(HERE / "README.md", gpu_table(json.loads(gpu.read_text())), "gpu-results")


if __name__ == "__main__":
    main()
