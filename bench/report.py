"""Write bench/README.md's results table from results/latest.json (run by run_all.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent


def table(d: dict) -> str:
    cp, t, m = d["control_plane"], d["targets"], d["machine"]
    rows = [
        ("kvd added time per step (scheduler thread)",
         f"{cp['added_step_seconds'] * 1e3:.2f} ms",
         f"<= 1.5 x stream RTT ({1.5 * cp['stream_rtt_seconds'] * 1e3:.2f} ms)",
         t["added_step_le_1.5x_stream_rtt"]),
        ("round trips per step (mean / max)",
         f"{cp['round_trips_per_step']:.2f} / {cp['max_round_trips_in_a_step']}", "<= 1",
         t["round_trips_per_step_le_1"]),
        ("round trips on idle steps", str(cp["round_trips_on_idle_steps"]), "0",
         t["no_round_trips_on_idle_steps"]),
        ("hit tokens kvd / vLLM (same capacity, LRU)",
         f"{d['hits']['kvd']} / {d['hits']['vllm']}", "equal", t["hits_equal_vllm"]),
        ("step calls/s, 8 clients x 64 keys", f"{d['daemon']['steps_per_second']:.0f}",
         ">= 5000", t["steps_per_second_ge_5000_8_clients"]),
        ("lookup p99 growth 10k -> 1M blocks", f"{t['lookup_p99_growth']:.2f}x", "<= 1.2x",
         t["lookup_p99_growth_le_1.2x"]),
        ("CPU data plane vs memcpy (32 KiB fragments)",
         f"{d['dataplane']['cpu_fraction_of_memcpy'] * 100:.0f}%", ">= 70%",
         t["dataplane_cpu_ge_70pct_memcpy"]),
        ("daemon memory per resident block (1M)", f"{d['memory']['bytes_per_block']:.0f} B",
         "<= 200 B", t["memory_le_200_bytes_per_block"]),
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
    unary = d["daemon"].get("throughput_unary")
    if unary:
        extra.append(f"- 8 clients with unary `Step` calls instead of `StepStream`: "
                     f"{unary[0]['steps_per_second']:.0f} step calls/s.")
    return head + body + ("\n" + "\n".join(extra) + "\n" if extra else "")


def main() -> None:
    d = json.loads((HERE / "results" / "latest.json").read_text())
    readme = HERE / "README.md"
    text = readme.read_text()
    new = re.sub(r"(<!-- results -->\n).*?(<!-- /results -->)",
                 lambda mm: mm.group(1) + table(d) + mm.group(2), text, flags=re.S)
    readme.write_text(new)


if __name__ == "__main__":
    main()
