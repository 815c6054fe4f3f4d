"""Warm restart under fire: engine processes on the fast path keep storing, loading and
resetting (tests/fault/warm_worker.py) while the daemon is SIGKILLed at random moments (mid-
store, mid-eviction: the pool is small; mid-reset) and restarted on the same directory, or
through systemd's descriptor store with the test playing systemd.

What must hold, in every round: every block the new daemon serves is byte-exact (the engines
check every load, those in flight across a restart included, and a verifier loads every HIT
after the workers stop); the accounting is exact (the daemon's READY blocks are exactly the
HITs); a daemon killed once more adopts the same blocks, which hit again without being stored
again; nothing stays held once the engines are gone, and no slot leaks. Layouts: a hybrid
model (three KV groups, four TP ranks writing their shards), an MLA model (one copy for all
ranks) and a plain one, side by side in one pool."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from kvd_proto import kvd_pb2
from tests.fault.warm_worker import universe
from tests.support.daemon import HEARTBEAT, LIVENESS, PY, ROOT, clean_env
from tests.support.engine import Engine, block_bytes_of
from tests.support.offload_engine import wait_idle
from tests.support.processes import readline_within
from tests.support.summary import record
from tests.support.systemd import FakeSystemd
from tests.support.waits import wait_until

pytestmark = [pytest.mark.fault, pytest.mark.multiproc]
ROUNDS = max(2, int(os.environ.get("KVD_SOAK_ROUNDS", "10")) // 5)
POOL = ("--pool-size", "16MiB", "--extent-size", "1MiB")
UNIVERSE = 160                  # logical blocks per model: more than the pool holds
# (model, block bytes, TP ranks, KV groups)
MODELS = [("warm-hybrid", 16384, 4, 3), ("warm-mla", 8192, 1, 1), ("warm-plain", 16384, 1, 1)]


@pytest.fixture
def state_dir(workdir: Path):
    path = Path("/dev/shm") / f"kvd-warm-{workdir.name}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _args(state: Path) -> tuple[str, ...]:
    return (*POOL, "--warm-restart", "--restart-dir", str(state))


# A short hold: engines that attach again without saying their copies are done let go soon.
ENV = clean_env(KVD_MANAGER_HEARTBEAT_INTERVAL=HEARTBEAT, KVD_MANAGER_LIVENESS_TIMEOUT=LIVENESS,
                KVD_SERVER_DRAIN_TIMEOUT="5s", KVD_RESTART_HOLD_TIMEOUT="1s")


def _workers(socket: str, seed: str, duration: float) -> list[subprocess.Popen[str]]:
    """One worker process per model; each one's stderr in a temporary file (`.errors`)."""
    out = []
    for model, block, ranks, groups in MODELS:
        errors = tempfile.TemporaryFile()  # noqa: SIM115 - closed with the worker
        proc = subprocess.Popen(
            [PY, "-m", "tests.fault.warm_worker", socket, model, f"{seed}-{model}",
             str(duration), str(UNIVERSE), str(block), str(ranks), str(groups)],
            env=clean_env(), stdout=subprocess.PIPE, stderr=errors, text=True, cwd=ROOT)
        proc.errors = errors                 # type: ignore[attr-defined]
        out.append(proc)
    return out


def _stop(workers: list[subprocess.Popen[str]]) -> None:
    for w in workers:
        w.kill()
        w.wait(10)
        w.errors.close()                     # type: ignore[attr-defined]


def _engine(socket: str, model: str, block: int, ranks: int) -> Engine:
    """A call-protocol engine in the workers' namespace of `model` (their layout)."""
    engine = Engine(socket, model, block=block, engine_id="verifier", register=False)
    layout = kvd_pb2.KvLayout(block_bytes=block, num_ranks=ranks, shard_bytes=block // ranks,
                              tokens_per_block=16, dtype="bfloat16", max_key_bytes=24)
    engine.reg = engine.call("RegisterSession", kvd_pb2.RegisterSessionRequest(
        engine=kvd_pb2.EngineIdentity(engine_id="verifier", pid=os.getpid()),
        model=model, layout=layout))
    return engine


def _close(engine: Engine) -> None:
    """CloseSession before the stream stops: its copies are done, nothing is held for it."""
    engine.call("CloseSession", kvd_pb2.CloseSessionRequest(), timeout=5)
    engine.close()


def _served(socket: str) -> dict[str, set[bytes]]:
    """Per model, the keys the daemon answers HIT, each loaded and checked byte for byte."""
    out: dict[str, set[bytes]] = {}
    for model, block, ranks, groups in MODELS:
        engine = _engine(socket, model, block, ranks)
        try:
            keys = universe(model, UNIVERSE, groups)
            hits: set[bytes] = set()
            for i in range(0, len(keys), 64):
                part = keys[i:i + 64]
                states = engine.lookup(part).states
                found = [k for k, s in zip(part, states, strict=True)
                         if s == kvd_pb2.BLOCK_STATE_HIT]
                for key, data in zip(found, engine.load(found) if found else [], strict=True):
                    assert data == block_bytes_of(key, block), \
                        f"{model}: the daemon served another key's bytes for {key.hex()}"
                    record("adopted blocks verified")
                hits |= set(found)
            out[model] = hits
        finally:
            _close(engine)
    return out


def _ready(doc: dict, model: str) -> int:
    """READY blocks of `model`'s namespace; 0 when it is gone (a namespace left with no block
    and no session is forgotten after the readers' grace)."""
    found = [ns for ns in doc["namespaces"] if ns["model"] == model]
    return found[0]["blocks"]["ready"] if found else 0


@pytest.fixture(params=["directory", "systemd"])
def launch(request, start_daemon, state_dir, workdir):
    """Start (or start again) the daemon with warm restart in one store: a directory, or
    systemd's descriptor store with this test playing systemd (tests/support/systemd.py)."""
    if request.param == "directory":
        yield lambda socket=None: start_daemon(*_args(state_dir), env=ENV, socket=socket)
        return
    unit = FakeSystemd(workdir)
    started = []

    def start(socket=None):
        daemon = unit.start(workdir, socket or str(workdir / "kvd.sock"), *POOL,
                            KVD_RESTART_HOLD_TIMEOUT="1s")
        started.append(daemon)
        return daemon

    try:
        yield start
    finally:
        for daemon in started:
            daemon.close()
        unit.close()
        for daemon in started:
            assert "Traceback" not in daemon.log(), daemon.log()


def test_the_daemon_killed_at_random_moments_keeps_serving_exact_bytes(launch):
    rng = random.Random(20261126)
    daemon = launch()
    socket = daemon.socket
    duration = 2.0 + 1.5 * ROUNDS
    workers = _workers(socket, "fire", duration)
    try:
        for _ in range(ROUNDS):
            time.sleep(rng.uniform(0.5, 1.2))
            daemon.proc.kill()                  # wherever it was: storing, evicting, resetting
            daemon.proc.wait(20)
            daemon = launch(socket)
            restart = daemon.stats()["restart"]
            assert restart["adopted"] and not restart["cold_reason"], restart
            record("warm restarts")
        reports = [json.loads(readline_within(w, duration + 60, w.errors))  # type: ignore
                   for w in workers]
    finally:
        _stop(workers)
    for (model, *_), report in zip(MODELS, reports, strict=True):
        assert report["corrupt"] == 0, f"{model}: {report['corrupt']} loads read wrong bytes"
        assert report["loads_checked"] > 0 and report["stored"] > 0, (model, report)
        record("torn blocks", report["corrupt"])
    # The workers are gone: nothing they held stays held.
    wait_until(lambda: not daemon.stats()["restart"]["held_sessions"], 15,
               "the previous daemon's engines to be let go")
    served = _served(socket)
    doc = daemon.stats()
    for model, *_ in MODELS:
        assert _ready(doc, model) == len(served[model]), \
            f"{model}: {_ready(doc, model)} READY blocks, {len(served[model])} served"

    # Killed once more with nothing running: the same blocks come back and hit again.
    daemon.proc.kill()
    daemon.proc.wait(20)
    daemon = launch(socket)
    restart = daemon.stats()["restart"]
    assert restart["blocks_adopted"] == sum(len(v) for v in served.values()), restart
    assert not restart["blocks_dropped"], restart
    assert _served(socket) == served
    _assert_no_slot_leaked(daemon)


def _assert_no_slot_leaked(daemon) -> None:
    """With every block dropped (kvd reset) and no session left, each namespace in turn is
    granted as many slots as the whole pool holds: a slot leaked by a restart (held, in limbo,
    granted to nobody) would make it short."""
    wait_idle(daemon)
    wait_until(lambda: not daemon.stats()["restart"]["held_sessions"], 15,
               "the previous daemon's engines to be let go")
    assert daemon.kvd("reset", "--yes").returncode == 0
    pool = daemon.stats()["pool"]
    for model, block, ranks, _ in MODELS:
        capacity = pool["extents_total"] * (pool["extent_bytes"] // block)
        probe = _engine(daemon.socket, model, block, ranks)
        try:
            keys = universe(f"probe-{model}", capacity, 1)
            grant = probe.call("PrepareStore", kvd_pb2.PrepareStoreRequest(keys=keys,
                                                                           req_id="p"))
            assert not grant.cannot_store and len(set(grant.slot_offsets)) == capacity, \
                f"{model}: {len(grant.slot_offsets)} of {capacity} slots: some are held"
            probe.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
                keys=list(grant.keys_to_store), success=False, req_id="p", epoch=grant.epoch))
        finally:
            _close(probe)
        wait_idle(daemon)
        record("leak checks")


def test_an_engine_that_died_while_the_daemon_was_down_holds_nothing(start_daemon,
                                                                     state_dir):
    daemon = start_daemon(*_args(state_dir), env=ENV)
    workers = _workers(daemon.socket, "dies", 30.0)
    try:
        wait_until(lambda: sum(ns["blocks"]["ready"] for ns in daemon.stats()["namespaces"])
                   > 50, 20, "the workers to store blocks")
        daemon.proc.kill()
        daemon.proc.wait(20)
        for w in workers:           # the engines die too, while no daemon runs
            w.send_signal(signal.SIGKILL)
            w.wait(10)
        daemon = start_daemon(*_args(state_dir), env=ENV, socket=daemon.socket)
        restart = daemon.stats()["restart"]
        assert restart["adopted"] and restart["previous_sessions"] == 0, restart
        assert restart["held_sessions"] == 0 and restart["held_extents"] == 0, restart
        assert daemon.stats()["pool"]["quarantined_slots"] == 0
        _assert_no_slot_leaked(daemon)
    finally:
        _stop(workers)
