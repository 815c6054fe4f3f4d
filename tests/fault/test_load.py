"""16 engine processes hammer one daemon at once for a bounded time, over a shared key
universe larger than the pool (so stores contend and the pool evicts). Afterwards the daemon's
state is compared with what the clients recorded and with a reference model rebuilt from the
namespace's event stream:

- no lost or duplicated completions: the daemon's started / completed / failed store counters
  equal the sums of the clients' grants and completions;
- no divergence: the set of HITs equals the model (stored events minus removed events), the
  ready count equals its size, and every HIT holds exactly its writer's bytes; no reader ever
  saw a wrong byte;
- nothing left behind: no pin, lease, pending store or session, free + used = total;
- the daemon's anonymous memory (RSS minus the shared pool) grows by a bounded amount.

`KVD_SOAK_LOAD_S` sets the duration (3 s by default).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading

import pytest

from kvd_proto import kvd_pb2
from tests.fault.load_worker import BLOCK, MODEL
from tests.support.daemon import PY, ROOT, clean_env
from tests.support.engine import Engine, block_bytes_of, keys_for
from tests.support.processes import readline_within, reap
from tests.support.summary import record

pytestmark = [pytest.mark.fault, pytest.mark.multiproc]
CLIENTS = 16
DURATION = float(os.environ.get("KVD_SOAK_LOAD_S", "3"))
UNIVERSE = 6000                     # > 1024 slots of 16 KiB in the 16 MiB pool
POOL = "16MiB"                      # small enough that even a slow machine fills it in time
RSS_GROWTH_LIMIT = 64 << 20


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/PID/status")


class Observer(threading.Thread):
    """Drains the namespace's events while the clients run: the reference model."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(name="observer", daemon=True)
        self.engine = engine
        self.stop = threading.Event()
        self.ready: set[bytes] = set()
        self.stored = self.removed = 0
        self.lock = threading.Lock()

    def drain(self) -> None:
        with self.lock:
            for _ in range(10_000):
                out = self.engine.call("TakeEvents", kvd_pb2.TakeEventsRequest(max_events=65536))
                for ev in out.events:
                    if ev.removed:
                        self.removed += 0 if ev.metadata_only else len(ev.keys)
                        self.ready.difference_update(ev.keys)
                    else:
                        self.stored += len(ev.keys)
                        self.ready.update(ev.keys)
                if not out.more:
                    return

    def run(self) -> None:
        while not self.stop.wait(0.3):
            self.drain()


def start_workers(daemon, n: int, reset_p: float = 0.0) -> list[subprocess.Popen[str]]:
    """n load_worker processes, each announced ready (they start on "go")."""
    procs = []
    for i in range(n):
        procs.append(subprocess.Popen(
            [PY, "-m", "tests.fault.load_worker", daemon.socket, f"w{i}", str(DURATION),
             str(UNIVERSE), str(reset_p)], env=clean_env(), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT))
    for p in procs:
        assert readline_within(p, 60).strip() == "ready"
    return procs


def go(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:                              # all start together
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()


def check_nobody_starved(records: list[dict]) -> None:
    """Every client got a fair share of the daemon: no starvation, no call stuck."""
    mean = sum(r["steps"] for r in records) / len(records)
    assert min(r["steps"] for r in records) >= mean / 4, [r["steps"] for r in records]
    slowest = max(r["slowest_step_s"] for r in records)
    assert slowest < 5.0, f"a step took {slowest:.1f}s"


@pytest.fixture
def daemon(start_daemon):
    """A daemon whose pool the load fills within the run, so it evicts under contention."""
    return start_daemon("--pool-size", POOL, "--extent-size", "4MiB")


def test_sixteen_engines_at_once_match_the_reference(daemon):
    observer_engine = Engine(daemon.socket, MODEL, block=BLOCK, engine_id="observer")
    observer = Observer(observer_engine)
    procs: list[subprocess.Popen[str]] = []
    try:
        procs += start_workers(daemon, CLIENTS)
        rss_before = rss_anon(daemon.proc.pid)
        observer.start()
        go(procs)
        peak = rss_before
        records = []
        for p in procs:
            line = readline_within(p, DURATION + 60)
            records.append(json.loads(line))
            peak = max(peak, rss_anon(daemon.proc.pid))
            assert p.wait(30) == 0, p.stderr.read() if p.stderr else ""
        observer.stop.set()
        observer.join(10)
        observer.drain()

        doc = daemon.stats()
        (ns,) = [n for n in doc["namespaces"] if n["model"] == MODEL]
        total = {k: sum(r[k] for r in records) for k in records[0]}
        assert total["corrupt"] == 0, "a client read a block that was not its key's bytes"
        assert total["mismatched"] == 0
        assert total["steps"] > CLIENTS * 10, f"too little load to mean anything: {total}"
        check_nobody_starved(records)
        # no lost or duplicated completions
        assert ns["stores_started_total"] == total["granted"], (ns, total)
        assert ns["stores_completed_total"] == total["completed"], (ns, total)
        assert ns["stores_failed_total"] == total["failed"], (ns, total)
        assert ns["evictions_total"] > 0, "the pool never filled: no eviction pressure"
        assert observer.stored == total["completed"]
        assert observer.removed == ns["evictions_total"]
        # no divergence between the index and the reference model
        universe = keys_for("load", UNIVERSE)
        got = [s for i in range(0, UNIVERSE, 2048)
               for s in observer_engine.lookup(universe[i:i + 2048]).states]
        hits = {k for k, s in zip(universe, got, strict=True) if s == kvd_pb2.BLOCK_STATE_HIT}
        record("load clients", CLIENTS)
        record("load steps", total["steps"])
        record("divergences", len(hits ^ observer.ready) + total["corrupt"] + total["mismatched"])
        assert hits == observer.ready, (len(hits), len(observer.ready))
        assert doc["blocks"]["ready"] == len(hits)
        for i in range(0, len(universe), 512):
            chunk = [k for k in universe[i:i + 512] if k in hits]
            if chunk:
                for key, data in zip(chunk, observer_engine.load(chunk), strict=True):
                    record("divergences", int(data != block_bytes_of(key, BLOCK)))
                    assert data == block_bytes_of(key, BLOCK), f"block {key.hex()} diverged"
        # nothing left behind
        doc = daemon.stats()
        record("leaks", doc["sessions"] - 1 + doc["stats"]["pins"] + doc["stats"]["leases"]
               + doc["blocks"]["storing"])
        assert doc["sessions"] == 1 and doc["stats"]["pins"] == 0
        assert doc["stats"]["leases"] == 0 and doc["blocks"]["storing"] == 0
        assert doc["pool"]["free_bytes"] + doc["pool"]["used_bytes"] == doc["pool"]["total_bytes"]
        growth = peak - rss_before
        assert growth < RSS_GROWTH_LIMIT, f"daemon anonymous memory grew by {growth >> 20} MiB"
    finally:
        observer.stop.set()
        for p in procs:
            reap(p)
        observer_engine.close()
    assert "Traceback" not in daemon.log()


def test_resets_under_load_never_expose_a_wrong_byte(daemon):
    """16 engines store, look up, load and complete while some of them reset the namespace:
    a block copied across a reset keeps its slot (zombie) until its copy completes, so no
    reader ever sees another key's bytes, and afterwards nothing is left held."""
    procs: list[subprocess.Popen[str]] = []
    try:
        procs += start_workers(daemon, CLIENTS, reset_p=0.01)
        go(procs)
        records = []
        for p in procs:
            records.append(json.loads(readline_within(p, DURATION + 60)))
            assert p.wait(30) == 0, p.stderr.read() if p.stderr else ""
        total = {k: sum(r[k] for r in records) for k in records[0]}
        record("load clients", CLIENTS)
        record("load steps", total["steps"])
        record("divergences", total["corrupt"] + total["mismatched"])
        assert total["resets"] > 0 and total["steps"] > CLIENTS * 10, total
        assert total["corrupt"] == 0, "a reader saw bytes that were not its key's"
        assert total["mismatched"] == 0
        check_nobody_starved(records)
        (ns,) = [n for n in daemon.stats()["namespaces"] if n["model"] == MODEL]
        assert ns["stores_started_total"] == total["granted"], (ns, total)
        doc = daemon.stats()
        leaks = (doc["sessions"] + doc["stats"]["pins"] + doc["stats"]["leases"]
                 + doc["blocks"]["storing"] + doc["blocks"]["zombie"])
        record("leaks", leaks)
        assert leaks == 0, doc
        assert doc["pool"]["free_bytes"] + doc["pool"]["used_bytes"] == doc["pool"]["total_bytes"]
    finally:
        for p in procs:
            reap(p)
    assert "Traceback" not in daemon.log()
