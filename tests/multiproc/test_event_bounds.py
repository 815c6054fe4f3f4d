"""Events nobody takes stay bounded, with a real daemon and real engine processes.

A namespace's stored / removed events wait for a TakeEvents. A writer that stores 4096
128-byte keys a step (each step evicts as many) while nobody takes them made the daemon grow
linearly (123 -> 419 MiB in 20 s; the old cap of 100,000 events allowed ~55 GiB). What must
hold: the daemon's memory levels off, the oldest events are dropped and counted
(`events_dropped_total` in kvd stats, `kvd_events_dropped_total` in /metrics), the next
TakeEvents answer says so (`events_dropped`) and still carries the newest events in order, and
a fast-path engine taking events over its channel sees the flag too (it counts the dropped
events and logs one warning).

Run as a module, this file is the writer process: `python -m tests.multiproc.test_event_bounds
SOCKET MODEL SEED STEPS`. `KVD_SOAK_LOAD_S` sets the soak variant's length (`make soak`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest

from kvd_proto import kvd_pb2
from kvd_proto.wire import KvLayout
from tests.support.daemon import PY, ROOT, clean_env
from tests.support.engine import Engine
from tests.support.processes import readline_within
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc
MODEL = "event-bounds-model"
BLOCK = 4096
LAYOUT = KvLayout(BLOCK, 1, BLOCK, 16, "bfloat16", 128)
POOL = ("--pool-size", "64MiB", "--extent-size", "4MiB")   # 16384 slots of 4 KiB
KEYS_PER_STEP = 4096
# What the daemon may grow by once the queue is full: the queue's bound (16 MiB) plus room
# for the allocator and gRPC's buffers. Unbounded, 100 steps grew it by ~150 MiB.
GROWTH_LIMIT = 40 << 20
SOAK_S = float(os.environ.get("KVD_SOAK_LOAD_S", "30"))


def step_keys(seed: str, step: int) -> list[bytes]:
    """4096 distinct 128-byte keys of one step."""
    return [hashlib.sha256(f"{seed}/{step}/{i}".encode()).digest() * 4
            for i in range(KEYS_PER_STEP)]


def _register(engine: Engine, model: str) -> kvd_pb2.RegisterSessionResponse:
    layout = kvd_pb2.KvLayout(block_bytes=BLOCK, num_ranks=1, shard_bytes=BLOCK,
                              tokens_per_block=16, dtype="bfloat16", max_key_bytes=128)
    engine.reg = engine.call("RegisterSession", kvd_pb2.RegisterSessionRequest(
        engine=kvd_pb2.EngineIdentity(engine_id="event-test", engine_kind="pytest",
                                      pid=os.getpid()),
        model=model, layout=layout))
    return engine.reg


def _writer(socket: str, model: str, seed: str, steps: int) -> int:
    """Store 4096 new keys a step, `steps` steps (0: until stdin closes), never taking an
    event; one JSON line per step."""
    engine = Engine(socket, engine_id=f"event-writer-{os.getpid()}", register=False)
    reg = _register(engine, model)
    print(json.dumps({"session": reg.session_id, "namespace": reg.namespace_id}), flush=True)
    step = 0
    while not steps or step < steps:
        keys = step_keys(seed, step)
        grant = engine.call("PrepareStore", kvd_pb2.PrepareStoreRequest(keys=keys),
                            timeout=30)
        if grant.keys_to_store:
            engine.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
                keys=grant.keys_to_store, success=True, epoch=grant.epoch), timeout=30)
        print(json.dumps({"step": step, "stored": len(grant.keys_to_store)}), flush=True)
        step += 1
    engine.close()
    return 0


class Writer:
    """The writer process; `step()` waits for its next step's line."""

    def __init__(self, socket: str, seed: str, steps: int) -> None:
        self.proc = subprocess.Popen(
            [PY, "-m", "tests.multiproc.test_event_bounds", socket, MODEL, seed, str(steps)],
            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            cwd=ROOT)
        self.hello = json.loads(readline_within(self.proc, 30))

    def step(self) -> dict[str, Any]:
        return json.loads(readline_within(self.proc, 60))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(15)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def rss(pid: int) -> int:
    """Resident bytes of process `pid` (the daemon's pool pages are faulted in at start)."""
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib << 10


def _namespace(doc: dict[str, Any]) -> dict[str, Any]:
    return next(ns for ns in doc["namespaces"] if ns["model"] == MODEL)


def _write(daemon: Any, seed: str, steps: int, warmup: int) -> tuple[int, int, list[int]]:
    """Run a writer for `steps` steps: the daemon's RSS after `warmup` steps and at the end,
    and the RSS every 10 steps."""
    writer = Writer(daemon.socket, seed, steps)
    samples = []
    try:
        start = 0
        for i in range(steps):
            assert writer.step()["stored"] == KEYS_PER_STEP
            if i + 1 == warmup:
                start = rss(daemon.proc.pid)
            if i % 10 == 0:
                samples.append(rss(daemon.proc.pid))
        assert writer.proc.wait(30) == 0
    finally:
        writer.close()
    return start, rss(daemon.proc.pid), samples


def _take_all(taker: Engine) -> tuple[list[kvd_pb2.TakeEventsResponse], int]:
    """TakeEvents until none are left: the answers and the keys they carried."""
    answers = []
    keys = 0
    while True:
        out = taker.call("TakeEvents", kvd_pb2.TakeEventsRequest(max_events=65536), timeout=30)
        answers.append(out)
        keys += sum(len(e.keys) for e in out.events)
        if not out.more:
            return answers, keys


def _metric(port: int, sample: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    m = re.search(r"^" + re.escape(sample) + r" (\S+)$", text, re.M)
    assert m, f"{sample} not exposed"
    return float(m.group(1))


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_events_nobody_takes_are_bounded_dropped_oldest_and_counted(start_daemon):
    port = _free_port()
    daemon = start_daemon(*POOL, "--metrics-port", str(port))
    steps = 100
    start, end, _ = _write(daemon, "bounds", steps, warmup=10)
    assert end - start < GROWTH_LIMIT, \
        f"the daemon grew by {(end - start) >> 20} MiB over {steps - 10} steps nobody took " \
        "events of"
    ns = _namespace(daemon.stats())
    dropped = ns.get("events_dropped_total")
    assert dropped, f"no event dropped after {2 * steps} events of 4096 keys: {ns}"
    assert _metric(port, f'kvd_events_dropped_total{{namespace="{ns["id"]}"}}') == dropped
    text = daemon.kvd("stats").stdout
    assert re.search(rf"events_dropped\D+{dropped}\b", text), text

    taker = Engine(daemon.socket, engine_id="event-taker", register=False)
    try:
        _register(taker, MODEL)
        answers, keys = _take_all(taker)
        first = answers[0]
        assert first.events_dropped == dropped, "the first answer after a drop says so"
        assert all(a.events_dropped == 0 for a in answers[1:]), "a drop is said once"
        # What is left is the newest events, whole and in order: the last step's removal of
        # the blocks it evicted, then its stores, in the order the writer offered them.
        last = answers[-1].events[-1]
        assert not last.removed and list(last.keys) == step_keys("bounds", steps - 1)
        assert keys < 2 * steps * KEYS_PER_STEP
        # Nothing left, nothing dropped since.
        again = taker.call("TakeEvents", kvd_pb2.TakeEventsRequest())
        assert not again.events and not again.more and again.events_dropped == 0
    finally:
        taker.close()
    assert _namespace(daemon.stats())["events_dropped_total"] == dropped


def test_a_fast_path_engine_is_told_events_were_dropped(start_daemon, caplog):
    """The channel's EVENTS answer carries the drop: the engine counts it and warns once."""
    from kvd_client.client import KvdClient
    from kvd_client.offload.session import OffloadSession
    from tests.support.offload_engine import close_session, settle, store

    daemon = start_daemon(*POOL)
    client = KvdClient(daemon.socket, model=MODEL, layout=LAYOUT, deadline_s=0.5,
                       engine_id="event-fastpath", engine_kind="pytest")
    session = OffloadSession(client, reserve=16, enable_events=True)
    try:
        assert client.wait_available(10)
        _write(daemon, "channel", 30, warmup=1)
        dropped = _namespace(daemon.stats())["events_dropped_total"]
        assert dropped > 0
        caplog.set_level(logging.WARNING, logger="kvd_client.offload.session")
        taken: list[Any] = []
        rounds = iter(range(1000))

        def drained() -> bool:
            """Store 8 new keys (a step with a store asks for events) and take what came:
            True once this step's own stored event came (everything before it was taken)."""
            mine = [hashlib.sha256(f"fast/{next(rounds)}/{i}".encode()).digest() * 4
                    for i in range(8)]
            store(session, mine)
            settle(session)
            taken.extend(session.take_events())
            return any(set(mine) <= set(e.keys) for e in taken if not e.removed)

        wait_until(drained, 60, "the engine to take every event up to its own store")
        assert session.events_dropped == dropped
        warnings = [r for r in caplog.records if "dropped" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        # Later answers drop nothing: no second warning.
        drained()
        assert session.events_dropped == dropped
        assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1
    finally:
        close_session(session)


def test_the_queue_keeps_the_newest_events_within_its_bytes():
    """The bound itself (no daemon): oldest dropped first and counted, order kept, and one
    event larger than the whole bound (a reset's removal of every block) cut to its newest
    keys."""
    from kvd_server.manager.events import EventQueue, event_memory
    from kvd_server.manager.types import OffloadEvent

    queue = EventQueue(max_bytes=64 << 10)
    events = [OffloadEvent(tuple(step_keys(f"q{i}", 0)[:100]), removed=bool(i % 2))
              for i in range(20)]
    for event in events:
        queue.emit(event)
    assert queue.bytes <= 64 << 10 and queue.bytes == sum(map(event_memory, events[-len(queue):]))
    assert queue.dropped_total == 20 - len(queue) > 0
    taken, more = queue.take(lambda key: True)
    assert taken == events[-len(taken):] and not more and queue.bytes == 0
    big = OffloadEvent(tuple(step_keys("big", 0)), removed=True)
    queue.emit(big)
    (part,), _ = queue.take(lambda key: True)
    assert part.keys == big.keys[-len(part.keys):] and 0 < len(part.keys) < len(big.keys)
    assert event_memory(part) <= 64 << 10 and queue.dropped_total == 20 - len(taken) + 1


@pytest.mark.soak
def test_soak_memory_levels_off_while_nobody_takes_events(start_daemon):
    """The issue's run, longer: KVD_SOAK_LOAD_S seconds of 4096-key steps; the daemon's RSS
    over the second half grows by no more than the allocator's noise."""
    daemon = start_daemon(*POOL)
    writer = Writer(daemon.socket, "soak", 0)
    samples: list[tuple[float, int]] = []
    try:
        started = time.monotonic()
        while time.monotonic() - started < SOAK_S:
            writer.step()
            samples.append((time.monotonic() - started, rss(daemon.proc.pid)))
    finally:
        writer.close()
    half = [r for t, r in samples if t >= SOAK_S / 2]
    first = [r for t, r in samples if t < SOAK_S / 2]
    assert half and first
    assert max(half) - max(first) < 16 << 20, \
        f"RSS still grows: {max(first) >> 20} MiB by half time, {max(half) >> 20} MiB after"
    ns = _namespace(daemon.stats())
    assert ns["events_dropped_total"] > 0


if __name__ == "__main__":
    sys.exit(_writer(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
