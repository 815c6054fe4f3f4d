"""The cluster tier's directory traffic at 8 to 512 nodes: one real `mooncake_master` on
loopback driven with the directory calls of N simulated nodes, the old scheme (manifests) and
the new (finds on demand) in one run.

Each simulated node has ENGINES engines stepping every STEP_S of trace time for TRACE_S; at an
engine step a new request arrives with probability ARRIVAL (seeded), its block keys taken from
bench/traces.py's chat/medium trace (each engine of each node replays the trace from its own
offset: every node sees the same kind of traffic, sessions shared between nodes). The store
holds the blocks of half the trace's prefixes (put for real before the run, as other nodes
published them).

- **new** (kvd_server/tiers/cluster/directory.py, the daemon's own `Directory` on a trace-time
  clock): a request's keys the node does not know (published here, found before) and did not
  find absent in the last NEGATIVE_S are asked in one `batch_is_exist` call at that engine's
  step (the daemon asks at most once per engine step per namespace); the answers go into the
  node's directory (found: known from then on; absent: remembered a second); the keys the
  node then computes are published (known, as its own). Plus the health check, one call per
  SYNC_S.
- **old** (the manifests of the previous scheme): every SYNC_S each node reads the node list,
  writes its manifest (its published keys, u8 length + key each) and reads the manifest of
  every other node of the namespace: N - 1 gets.

The calls of a cell are scheduled in trace time, then made for real against the master from
WORKERS threads over CLIENTS store clients, back to back (at most MAX_CALLS of them: a cell
with more makes a seeded uniform sample of that many, and its counts are the schedule's):
directory calls and bytes per node per second of trace time (the schedule's, exact), the
calls' latency p50/p99 under that load (measured), the most calls one engine step made, and
the time from a block's publication on one node to HIT_PENDING on another: new, measured
(a put, then the other node's ask at its engine's next step: the ask's latency, within one
STEP_S); old, the mean wait for the next sync (SYNC_S) plus the reader's N - 1 manifest reads
at the measured get latency.

Run: `python bench/cluster_scale.py [--quick]` (needs the `cluster` extra and Debian's
libibverbs1 librdmacm1, and says so and skips otherwise); it writes `cluster_scale` into
bench/results/latest.json and its section of bench/README.md. `make bench` runs it.
"""

from __future__ import annotations

import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from cluster_tier import cluster_main  # noqa: E402
from run_all import commit, machine  # noqa: E402
from traces import block_keys, generate  # noqa: E402

from kvd_server.tiers.cluster.directory import Directory  # noqa: E402
from kvd_server.tiers.cluster.names import block_name  # noqa: E402
from kvd_server.tiers.cluster.tier import PROBE  # noqa: E402
from tests.support import mooncake  # noqa: E402

NODES = (8, 32, 128, 512)
ENGINES = 4                   # engines per node
STEP_S = 0.02                 # an engine step (trace time)
ARRIVAL = 0.2                 # a new request at an engine step with this probability
TRACE = ("chat", "medium")
TOKENS_PER_BLOCK = 16
TRACE_S = 2.0                 # trace time each node replays (--quick: 1 s)
SYNC_S = 1.0                  # the old scheme's exchange, the new one's health check
NAMESPACE = "bench-scale-ns"
MAX_KEYS = 1 << 16            # a node's directory bound (kvd: tiers.cluster.size / block)
VALUE_BYTES = 512             # the prefilled blocks (the directory, not the data, is measured)
CLIENTS = 4
WORKERS = 8
MAX_CALLS = 20_000            # real calls per cell (more: a seeded sample)
SEED = 11


@dataclass(slots=True)
class Call:
    kind: str                  # "exists", "get", "put"
    names: list[str]
    value: bytes = b""
    step: tuple[int, int, int] | None = None     # (node, engine, step) of an engine's ask


@dataclass(slots=True)
class Schedule:
    calls: list[Call] = field(default_factory=list)
    bytes: int = 0
    per_step: dict[tuple[int, int, int], int] = field(default_factory=dict)


def _requests() -> list[list[bytes]]:
    shape, size = TRACE
    return [list(block_keys(r.tokens, TOKENS_PER_BLOCK)) for r in generate(shape, size)]


def _stored(requests: list[list[bytes]]) -> set[bytes]:
    """The keys the store holds: those of every other request (as other nodes published)."""
    return {k for keys in requests[::2] for k in keys}


def _arrivals(n: int, trace_s: float, requests: int) -> list[tuple[float, int, int, int, int]]:
    """(time, node, engine, step, request index) of every arrival, in time order."""
    rng = random.Random(SEED)
    steps = int(trace_s / STEP_S)
    out = []
    for node in range(n):
        for engine in range(ENGINES):
            at = (node * ENGINES + engine) * 37
            for step in range(steps):
                if rng.random() < ARRIVAL:
                    out.append((step * STEP_S, node, engine, step, at % requests))
                    at += 1
    out.sort()
    return out


def new_scheme(n: int, trace_s: float, requests: list[list[bytes]], stored: set[bytes]
               ) -> Schedule:
    clock = [0.0]
    nodes = [Directory(f"node-{i}", MAX_KEYS, clock=lambda: clock[0]) for i in range(n)]
    out = Schedule()
    for t, node, engine, step, r in _arrivals(n, trace_s, len(requests)):
        clock[0] = t
        d = nodes[node]
        keys = requests[r]
        _, ask = d.split(NAMESPACE, keys)
        if ask:
            names = [block_name(NAMESPACE, k) for k in ask]
            out.calls.append(Call("exists", names, step=(node, engine, step)))
            out.bytes += sum(map(len, names)) + len(names)
            out.per_step[(node, engine, step)] = out.per_step.get((node, engine, step), 0) + 1
            d.answered(NAMESPACE, ask, [k in stored for k in ask])
        for k in keys:                       # computed (or promoted): held here from now on
            if not d.known(NAMESPACE, k):
                d.published(NAMESPACE, k)
    checks = n * int(trace_s / SYNC_S)       # the health check
    out.calls += [Call("exists", [PROBE]) for _ in range(checks)]
    out.bytes += checks * (len(PROBE) + 1)
    return out


def _manifest(keys: int) -> bytes:
    return b"KVDM" + keys.to_bytes(4, "little") + bytes(33) * keys


def old_scheme(n: int, trace_s: float, requests: list[list[bytes]], stored: set[bytes]
               ) -> tuple[Schedule, int]:
    """The manifests' calls, and the mean manifest's size (what each node published)."""
    published = [set() for _ in range(n)]
    for _, node, _, _, r in _arrivals(n, trace_s, len(requests)):
        published[node].update(requests[r])
    mean_keys = int(statistics.mean(len(p) for p in published))
    manifest = _manifest(mean_keys)
    node_list = b"KVDN" + n.to_bytes(4, "little") + b"\x08node-xyz" * n
    out = Schedule()
    for _ in range(int(trace_s / SYNC_S)):
        for node in range(n):
            out.calls.append(Call("get", ["kvd/v1/nodes"]))
            out.calls.append(Call("put", [f"kvd/v1/m/{NAMESPACE}/node-{node}"], manifest))
            out.bytes += len(node_list) + len(manifest)
            for other in range(n):
                if other != node:
                    out.calls.append(Call("get", [f"kvd/v1/m/{NAMESPACE}/node-{other}"]))
                    out.bytes += len(manifest)
    return out, len(manifest)


class Clients:
    """CLIENTS real Mooncake clients (no segment) and one holding the store's segment."""

    def __init__(self, master: mooncake.Master) -> None:
        from mooncake.store import MooncakeDistributedStore

        def client(segment: int) -> object:
            c = MooncakeDistributedStore()
            rc = c.setup("127.0.0.1", master.metadata_url, segment, 64 << 20, "tcp", "",
                         master.address)
            if rc:
                raise RuntimeError(f"Mooncake setup failed: {rc}")
            return c

        self.holder = client(1 << 30)
        self.clients = [client(0) for _ in range(CLIENTS)]
        self._next = 0
        self._lock = threading.Lock()

    def pick(self) -> object:
        with self._lock:
            self._next = (self._next + 1) % len(self.clients)
            return self.clients[self._next]

    def close(self) -> None:
        for c in [self.holder, *self.clients]:
            c.close()


def _put(client: object, name: str, value: bytes) -> None:
    rc = client.upsert(name, value)
    if rc:
        raise RuntimeError(f"put {name}: code {rc}")


def prefill(clients: Clients, stored: set[bytes], n_max: int, manifest_bytes: int) -> None:
    """The blocks other nodes published, the manifests and the node list (old scheme)."""
    value = bytes(VALUE_BYTES)
    names = [block_name(NAMESPACE, k) for k in stored]
    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(lambda name: _put(clients.holder, name, value), names))
        manifest = _manifest((manifest_bytes - 8) // 33)
        list(pool.map(lambda i: _put(clients.holder, f"kvd/v1/m/{NAMESPACE}/node-{i}",
                                     manifest), range(n_max)))
    _put(clients.holder, "kvd/v1/nodes", b"KVDN" + n_max.to_bytes(4, "little")
         + b"\x08node-xyz" * n_max)


def execute(clients: Clients, calls: list[Call]) -> dict:
    """Make `calls` for real (a sample of MAX_CALLS at most), back to back from WORKERS
    threads: their latency and the rate the master served them at."""
    sample = calls if len(calls) <= MAX_CALLS else random.Random(SEED).sample(calls, MAX_CALLS)
    latencies: list[float] = []

    def one(call: Call) -> float:
        client = clients.pick()
        t0 = time.perf_counter()
        if call.kind == "exists":
            answers = client.batch_is_exist(call.names)
            if any(a < 0 for a in answers):
                raise RuntimeError(f"batch_is_exist: {answers[:4]}")
        elif call.kind == "get":
            client.get(call.names[0])
        else:
            _put(client, call.names[0], call.value)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(WORKERS) as pool:
        latencies = list(pool.map(one, sample))
    wall = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else latencies * 99
    return {"made": len(sample), "sampled": len(sample) < len(calls),
            "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3,
            "served_per_s": len(sample) / wall}


def publication_to_found(clients: Clients, tries: int = 200) -> dict:
    """A block put by one client, then asked about by another (the new scheme's path)."""
    times = []
    for i in range(tries):
        name = block_name(NAMESPACE, f"fresh-{i}".encode())
        _put(clients.holder, name, bytes(VALUE_BYTES))
        t0 = time.perf_counter()
        answer = clients.pick().batch_is_exist([name])
        times.append(time.perf_counter() - t0)
        if answer != [1]:
            raise RuntimeError(f"a fresh block not found: {answer}")
    q = statistics.quantiles(times, n=100)
    return {"ask_p50_ms": q[49] * 1e3, "ask_p99_ms": q[98] * 1e3}


def run(base: Path, quick: bool, progress: Callable[[str], None] = print) -> dict:
    trace_s = 1.0 if quick else TRACE_S
    nodes = NODES[:3] if quick else NODES
    requests = _requests()
    stored = _stored(requests)
    master = mooncake.Master(base)
    master.start()
    clients = None
    try:
        clients = Clients(master)
        olds = {n: old_scheme(n, trace_s, requests, stored) for n in nodes}
        prefill(clients, stored, max(nodes), max(m for _, m in olds.values()))
        rows = []
        for n in nodes:
            new = new_scheme(n, trace_s, requests, stored)
            old, manifest_bytes = olds[n]
            row = {"nodes": n}
            for name, sched in (("new", new), ("old", old)):
                measured = execute(clients, sched.calls)
                row[name] = {
                    "calls_per_node_per_s": len(sched.calls) / n / trace_s,
                    "bytes_per_node_per_s": sched.bytes / n / trace_s,
                    "master_calls_per_s": len(sched.calls) / trace_s,
                    **measured}
            asks = [c for c in new.calls if c.step is not None]
            row["new"]["most_calls_per_engine_step"] = max(new.per_step.values(), default=0)
            row["new"]["keys_per_ask"] = statistics.mean(len(c.names) for c in asks) \
                if asks else 0.0
            row["old"]["manifest_bytes"] = manifest_bytes
            rows.append(row)
            progress(f"{n} nodes: new {row['new']['calls_per_node_per_s']:.1f} calls/node/s "
                     f"(p99 {row['new']['p99_ms']:.2f} ms), old "
                     f"{row['old']['calls_per_node_per_s']:.1f} calls/node/s (p99 "
                     f"{row['old']['p99_ms']:.2f} ms)")
        found = publication_to_found(clients)
    finally:
        if clients is not None:
            clients.close()
        master.stop()
    for row in rows:
        n = row["nodes"]
        row["new"]["publication_to_pending_ms"] = max(found["ask_p99_ms"], STEP_S * 1e3)
        row["old"]["publication_to_pending_ms"] = SYNC_S * 1e3 + (n - 1) * row["old"]["p50_ms"]
    per_node = [r["new"]["calls_per_node_per_s"] for r in rows]
    spread = max(per_node) / min(per_node) - 1
    out = {"machine": machine(), "commit": commit(), "quick": quick, "trace": "/".join(TRACE),
           "trace_s": trace_s, "engines_per_node": ENGINES, "step_ms": STEP_S * 1e3,
           "arrival_per_step": ARRIVAL, "sync_s": SYNC_S, "rows": rows,
           "publication_to_found": found, "new_per_node_spread": spread}
    out["targets"] = {
        "new: calls per node per second within 10% from the fewest to the most nodes":
            spread <= 0.10,
        "new: at most one batched call per engine step per namespace":
            all(r["new"]["most_calls_per_engine_step"] <= 1 for r in rows)}
    return out


def table(t: dict) -> str:
    m = t["machine"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores. Commit: `{t['commit']}`. One Mooncake "
             f"master on loopback; {t['engines_per_node']} engines per node stepping every "
             f"{t['step_ms']:.0f} ms ({t['arrival_per_step']:.0%} of steps bring a request of "
             f"{t['trace']}), {t['trace_s']:.0f} s of trace time per cell; old scheme: a sync "
             f"every {t['sync_s']:.0f} s.", "",
             "| nodes | new: calls / node / s | new: bytes / node / s | new: p50 / p99 ms | "
             "old: calls / node / s | old: bytes / node / s | old: p50 / p99 ms | master "
             "calls / s new / old | publication to HIT_PENDING new / old |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in t["rows"]:
        nw, od = r["new"], r["old"]
        lines.append(
            f"| {r['nodes']} | {nw['calls_per_node_per_s']:.1f} | "
            f"{nw['bytes_per_node_per_s'] / 1e3:.1f} KB | {nw['p50_ms']:.2f} / "
            f"{nw['p99_ms']:.2f} | {od['calls_per_node_per_s']:.1f} | "
            f"{od['bytes_per_node_per_s'] / 1e6:.2f} MB | {od['p50_ms']:.2f} / "
            f"{od['p99_ms']:.2f}{' (sampled)' if od['sampled'] else ''} | "
            f"{nw['master_calls_per_s']:.0f} / {od['master_calls_per_s']:.0f} | "
            f"{nw['publication_to_pending_ms']:.0f} ms / "
            f"{od['publication_to_pending_ms']:.0f} ms |")
    first = t["rows"][0]["new"]
    lines += ["", f"New scheme: {first['keys_per_ask']:.1f} keys per ask, at most "
              f"{max(r['new']['most_calls_per_engine_step'] for r in t['rows'])} call per "
              f"engine step; calls per node per second spread {t['new_per_node_spread']:.1%} "
              f"from {t['rows'][0]['nodes']} to {t['rows'][-1]['nodes']} nodes. A fresh "
              f"block's ask: p50 {t['publication_to_found']['ask_p50_ms']:.2f} ms, p99 "
              f"{t['publication_to_found']['ask_p99_ms']:.2f} ms (then HIT_PENDING at the "
              "engine's next step).", "", "| target | |", "|---|---|"]
    lines += [f"| {n} | {'met' if ok else '**missed**'} |" for n, ok in t["targets"].items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    return cluster_main(__doc__, "bench/cluster_scale.py", "cluster_scale",
                        "cluster-scale-results", "8 to 128 nodes, 1 s of trace each", run, table)


if __name__ == "__main__":
    sys.exit(main())
