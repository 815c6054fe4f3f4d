"""A KvdClient driven like an engine scheduler (a thread stepping every few milliseconds:
lookups with leases, loads held across a step, stores written into the pool and completed with
the next step) while the daemon is SIGKILLed and restarted, SIGTERMed (drained) and restarted,
or SIGSTOPped past both the call deadline and the liveness timeout.

Checked on every call, during the whole outage: no exception reaches the caller and no call
takes longer than its deadline + a small slack. Checked after: the client is stepping
successfully again within 2 s of the daemon serving, it stores again, its new blocks are HITs
holding the bytes it wrote (through the pool mapping of the *new* daemon), and the daemon's
accounting is clean. A drain does not wait on the degraded client's pins.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvd_client.client import KvdClient
from kvd_proto import kvd_pb2
from kvd_proto.wire import KvLayout
from tests.support.daemon import EXTENT, POOL
from tests.support.engine import Engine, block_bytes_of
from tests.support.waits import wait_until

pytestmark = [pytest.mark.fault, pytest.mark.multiproc]
MODEL = "outage-model"
BLOCK = 16 * 1024
DEADLINE = 0.3
SLACK = 0.4                 # scheduling noise on a loaded 2-core machine
BACK_WITHIN = 2.0           # the client steps again within this long of the daemon serving
DOWN_S = 1.5                # long enough for the client's reconnect backoff to grow


class Scheduler(threading.Thread):
    """Steps like an engine's scheduler loop and records what every call did."""

    def __init__(self, client: KvdClient) -> None:
        super().__init__(name="fake-scheduler", daemon=True)
        self.client = client
        self.stop = threading.Event()
        self.calls: list[tuple[float, float, bool, int]] = []   # start, seconds, ok, generation
        self.errors: list[BaseException] = []
        self.completed: dict[int, list[bytes]] = {}              # generation -> keys completed
        self.hits: dict[int, int] = {}                           # generation -> HITs seen
        self._n = 0
        self._lock = threading.Lock()

    def _key(self) -> bytes:
        self._n += 1
        return b"outage-%08d" % self._n

    def _step(self, ops: list[kvd_pb2.StepOp]) -> list[kvd_pb2.StepResult] | None:
        gen = self.client.generation
        t0 = time.monotonic()
        try:
            res = self.client.step(ops)
        except BaseException as exc:  # noqa: BLE001 - the promise under test: never
            self.errors.append(exc)
            res = None
        with self._lock:
            self.calls.append((t0, time.monotonic() - t0, res is not None, gen))
        return res

    def run(self) -> None:
        c = self.client
        in_flight: list[tuple[int, list[bytes]]] = []   # completes queued, by generation
        recent: list[bytes] = []
        for _ in range(100_000):                         # bounded; stopped long before
            if self.stop.is_set():
                return
            gen = c.generation
            keys = [self._key() for _ in range(2)]
            probe = recent[-4:]
            res = self._step([
                kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(keys=probe, lease_ms=200)),
                kvd_pb2.StepOp(prepare_store=kvd_pb2.PrepareStoreRequest(keys=keys))])
            with self._lock:
                if res is not None and c.generation == gen:
                    # the completes queued after the previous step rode with this one
                    for g, done in in_flight:
                        if g == gen:
                            self.completed.setdefault(g, []).extend(done)
            in_flight = []
            if res is None:
                time.sleep(0.005)
                continue
            states = res[0].lookup.states
            hits = [k for k, s in zip(probe, states, strict=False)
                    if s == kvd_pb2.BLOCK_STATE_HIT]
            with self._lock:
                self.hits[gen] = self.hits.get(gen, 0) + len(hits)
            if hits:  # a load held across a step: pin now, release with the next round trip
                load = self._step([kvd_pb2.StepOp(prepare_load=kvd_pb2.PrepareLoadRequest(
                    keys=hits[:1]))])
                if load is not None:
                    c.queue(kvd_pb2.StepOp(complete_load=kvd_pb2.CompleteLoadRequest(
                        keys=hits[:1], epoch=load[0].prepare_load.epoch)))
            grant = res[1].prepare_store
            pool = c.pool
            written: list[bytes] = []
            try:
                for key, offset in zip(grant.keys_to_store, grant.slot_offsets, strict=True):
                    if pool is None:
                        break
                    view = pool.view(offset, BLOCK)
                    view[:] = block_bytes_of(key, BLOCK)
                    view.release()
                    written.append(key)
            except (ValueError, BufferError):
                written = []                             # mapping gone with the old daemon
            if written and len(written) == len(grant.keys_to_store):
                c.queue(kvd_pb2.StepOp(complete_store=kvd_pb2.CompleteStoreRequest(
                    keys=written, success=True, epoch=grant.epoch)))
                in_flight.append((gen, written))
                recent.extend(written)
            time.sleep(0.005)

    def completed_in(self, gen: int) -> list[bytes]:
        with self._lock:
            return list(self.completed.get(gen, []))

    def hits_in(self, gen: int) -> int:
        with self._lock:
            return self.hits.get(gen, 0)

    def first_ok_after(self, t: float) -> float | None:
        with self._lock:
            return next((s + d for s, d, ok, _ in self.calls if ok and s >= t), None)

    def worst(self) -> float:
        with self._lock:
            return max(d for _, d, _, _ in self.calls)


@pytest.fixture
def engine_loop(daemon):
    client = KvdClient(daemon.socket, model=MODEL, deadline_s=DEADLINE,
                       layout=KvLayout(BLOCK, 1, BLOCK, 16, "bfloat16"))
    assert client.wait_available(10)
    sched = Scheduler(client)
    sched.start()
    try:
        wait_until(lambda: sched.hits_in(client.generation) >= 4, 10,
                   "the scheduler to get hits before the fault")
        yield daemon, client, sched
    finally:
        sched.stop.set()
        sched.join(10)
        client.close()
    assert not sched.is_alive()


def _check_back(sched: Scheduler, client: KvdClient, socket: str, t_back: float) -> None:
    """The client steps within BACK_WITHIN of `t_back`, stores again, and its new blocks are
    whole HITs; no call ever raised or overran its deadline."""
    first = wait_until(lambda: sched.first_ok_after(t_back), BACK_WITHIN + 3,
                       "a successful step after the daemon came back")
    assert first - t_back < BACK_WITHIN, f"client stepped again only {first - t_back:.2f}s later"
    gen = client.generation
    wait_until(lambda: len(sched.completed_in(gen)) >= 6 and sched.hits_in(gen) >= 2, 10,
               "stores completed and hits seen after the reconnect")
    sched.stop.set()
    sched.join(10)
    assert not sched.errors, sched.errors[:3]
    worst = sched.worst()
    assert worst < DEADLINE + SLACK, f"a step took {worst:.2f}s (deadline {DEADLINE}s)"
    keys = sched.completed_in(gen)
    reader = Engine(socket, MODEL, block=BLOCK, engine_id="reader")
    try:
        states = reader.lookup(keys).states
        assert list(states) == [kvd_pb2.BLOCK_STATE_HIT] * len(keys)
        for key, data in zip(keys, reader.load(keys), strict=True):
            assert data == block_bytes_of(key, BLOCK), "bytes written after the reconnect lost"
    finally:
        reader.close()


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_daemon_dies_and_comes_back_under_a_stepping_client(engine_loop, start_daemon, how):
    daemon, client, sched = engine_loop
    gen0 = client.generation
    t_fault = time.monotonic()
    daemon.proc.send_signal(getattr(signal, how))
    code = daemon.proc.wait(15)
    exited = time.monotonic() - t_fault
    if how == "SIGTERM":
        # The drain waits for loads in flight; the client degrades on the DRAINING notice and
        # drops its session, so its held pins do not keep the daemon up to the drain timeout.
        assert code == 0
        assert exited < 4.0, f"drain took {exited:.1f}s with a degraded client"
    wait_until(lambda: not client.available, 3, "the client to notice")
    time.sleep(DOWN_S)
    assert not sched.errors, sched.errors[:3]
    d2 = start_daemon("--pool-size", POOL, "--extent-size", EXTENT, socket=daemon.socket)
    t_back = time.monotonic()
    _check_back(sched, client, d2.socket, t_back)
    assert client.generation > gen0
    assert client.flush(), "the last step's queued completions"  # the scheduler stopped mid-store
    doc = d2.stats()
    assert doc["sessions"] == 1 and doc["blocks"]["storing"] == 0
    assert doc["pool"]["free_bytes"] + doc["pool"]["used_bytes"] == doc["pool"]["total_bytes"]


def test_daemon_stopped_past_liveness_then_resumed(engine_loop):
    daemon, client, sched = engine_loop
    before = daemon.stats()
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: not client.available, DEADLINE + 3, "the client to degrade")
        time.sleep(DOWN_S)                       # past the deadline and the 1 s liveness
        assert not sched.errors, sched.errors[:3]
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    t_back = time.monotonic()
    _check_back(sched, client, daemon.socket, t_back)
    # The old session (and any attach that was queued while the daemon was stopped) is gone
    # with everything it held; blocks completed before the stall are still there.
    client.close()
    wait_until(lambda: daemon.stats()["sessions"] == 0, 5, "every session of the client to end")
    doc = daemon.stats()
    assert doc["stats"]["pins"] == 0 and doc["stats"]["leases"] == 0
    assert doc["blocks"]["storing"] == 0 and doc["blocks"]["pinned"] == 0
    assert doc["blocks"]["ready"] >= before["blocks"]["ready"]
    assert doc["pool"]["free_bytes"] + doc["pool"]["used_bytes"] == doc["pool"]["total_bytes"]
