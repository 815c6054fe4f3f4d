"""An engine dies (SIGKILL) or hangs (SIGSTOP) at a chosen point of its work, next to a live
engine that holds state of its own. Afterwards the daemon's accounting is exact: the dead
session is gone with every pin, lease and pending store it owned, the live engine's pin and
pending store are untouched, free + used = total, nothing the victim half-wrote is visible,
every HIT holds its writer's bytes, and the whole pool can be reserved again (no slot leaked).

SIGKILL closes the victim's sockets, so its heartbeat stream ends and the session ends at
once; SIGSTOP keeps the connection open and silent, so only the liveness timeout (1 s in these
tests) can end it. Both paths are checked for every phase.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any

import pytest

from kvd_proto import kvd_pb2
from tests.fault.crash_points import MODEL, PHASES, READY_N, READY_SEED, new_keys
from tests.support.daemon import PY, ROOT, clean_env
from tests.support.engine import Engine, block_bytes_of, keys_for
from tests.support.processes import readline_within, reap
from tests.support.summary import record
from tests.support.waits import wait_until

pytestmark = [pytest.mark.fault, pytest.mark.multiproc]
LIVENESS_S = 1.0            # tests/support/daemon.py starts daemons with a 1s liveness timeout
SETTLE_S = LIVENESS_S + 4   # liveness + sweep interval + generous scheduling slack


def start_victim(socket: str, phase: str, seed: str) -> tuple[subprocess.Popen[str], dict]:
    proc = subprocess.Popen([PY, "-m", "tests.fault.crash_points", socket, phase, seed],
                            env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        return proc, json.loads(readline_within(proc, 30))
    except BaseException:
        reap(proc)
        raise


def sessions(daemon) -> list[kvd_pb2.SessionInfo]:
    return list(daemon.admin().ListSessions(kvd_pb2.ListSessionsRequest(), timeout=5).sessions)


def check_pool_identity(doc: dict[str, Any]) -> None:
    pool = doc["pool"]
    assert pool["free_bytes"] + pool["used_bytes"] == pool["total_bytes"], pool
    assert 0 <= pool["extents_free"] <= pool["extents_total"], pool


def check_every_hit_is_whole(socket: str, keys: list[bytes], model: str = MODEL) -> int:
    """A fresh reader loads every HIT among `keys` and checks its bytes; the number of hits."""
    reader = Engine(socket, model, engine_id="reader")
    try:
        states = reader.lookup(keys).states
        hits = [k for k, s in zip(keys, states, strict=True) if s == kvd_pb2.BLOCK_STATE_HIT]
        if hits:
            for key, data in zip(hits, reader.load(hits), strict=True):
                assert data == block_bytes_of(key), f"block {key.hex()} is torn or foreign"
        return len(hits)
    finally:
        reader.close()


def check_no_slot_leaked(socket: str, doc: dict[str, Any], model: str = MODEL) -> None:
    """With nothing pinned or pending, a store of as many new keys as the whole pool holds
    must be granted (by evicting); a leaked pin or pending slot would make it `cannot_store`."""
    ns = next(n for n in doc["namespaces"] if n["model"] == model)
    capacity = doc["pool"]["extents_total"] * (doc["pool"]["extent_bytes"] // ns["slot_bytes"])
    probe = Engine(socket, model, engine_id="probe")
    try:
        keys = keys_for("fill-probe", capacity)
        grant = probe.call("PrepareStore", kvd_pb2.PrepareStoreRequest(keys=keys, req_id="p"))
        assert not grant.cannot_store, "a slot is still held by a dead session"
        assert len(grant.keys_to_store) == capacity
        assert len(set(grant.slot_offsets)) == capacity, "one slot handed out twice"
        probe.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
            keys=list(grant.keys_to_store), success=False, req_id="p", epoch=grant.epoch))
    finally:
        probe.close()


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("phase", PHASES)
def test_engine_dies_at_a_chosen_point(daemon, phase, how):
    ready = keys_for(READY_SEED, READY_N)
    survivor = Engine(daemon.socket, MODEL, engine_id="survivor")
    victim: subprocess.Popen[str] | None = None
    try:
        survivor.store(ready)
        # The survivor's own state: one pin and one pending store, which must outlive the victim.
        held = survivor.call("PrepareLoad", kvd_pb2.PrepareLoadRequest(keys=ready[7:8]))
        own = survivor.store(keys_for("survivor-own", 1), complete=False)
        base = daemon.stats()
        assert base["stats"]["pins"] == 1 and base["blocks"]["storing"] == 1

        victim, said = start_victim(daemon.socket, phase, f"{phase}-{how}")
        during = daemon.stats()
        assert during["sessions"] == 2
        assert during["stats"]["pins"] == 1 + said["pins"], (said, during["stats"])
        assert during["stats"]["leases"] == said["leases"], (said, during["stats"])
        assert during["blocks"]["storing"] == 1 + said["storing"], (said, during["blocks"])

        t0 = time.monotonic()
        os.kill(victim.pid, getattr(signal, how))

        def settled() -> bool:
            doc = daemon.stats()
            # A killed victim's session may end while its process is still exiting (not yet a
            # zombie): the quarantine then holds its pins until a sweep sees the process gone.
            return (doc["sessions"] == 1 and doc["stats"]["pins"] == 1
                    and doc["stats"]["leases"] == 0 and doc["blocks"]["storing"] == 1
                    and (how == "SIGSTOP" or doc["pool"]["quarantined_pins"] == 0))

        wait_until(settled, SETTLE_S, f"the victim's session ({phase}, {how}) to be cleaned up")
        took = time.monotonic() - t0
        doc = daemon.stats()
        if how == "SIGSTOP" or phase == "unregistered":
            # A silent session lives until the liveness timeout: the reaper ended it.
            assert took >= LIVENESS_S - 0.3, f"session ended after {took:.2f}s, before liveness"
            assert doc["clients"]["reaped_total"] == base["clients"]["reaped_total"] + 1
        check_pool_identity(doc)
        (info,) = sessions(daemon)
        assert info.peer_pid == os.getpid(), "the surviving session is the live engine's"
        assert (info.pins, info.pending_stores, info.leases) == (1, 1, 0)
        if how == "SIGSTOP":
            # A stopped victim may resume mid-copy: what it pinned or leased stays pinned (and
            # what it was writing stays out of use) until its process is gone.
            assert doc["pool"]["quarantined_pins"] == said["pins"] + said["leases"], doc["pool"]
            if said["pins"] + said["leases"]:
                assert doc["blocks"]["pinned"] > 1
            reap(victim, close=False)
            wait_until(lambda: daemon.stats()["pool"]["quarantined_pins"] == 0, SETTLE_S,
                       "the stopped victim's held pins to come back once it is gone")
            doc = daemon.stats()
        assert doc["pool"]["quarantined_pins"] == 0
        assert doc["blocks"]["pinned"] == 1

        # Nothing the victim half-wrote is visible; what it completed is.
        states = survivor.lookup(new_keys(f"{phase}-{how}")).states
        expect = kvd_pb2.BLOCK_STATE_HIT if phase == "between_steps" else kvd_pb2.BLOCK_STATE_MISS
        assert list(states) == [expect] * 4, (phase, list(states))
        assert list(survivor.lookup(ready).states) == [kvd_pb2.BLOCK_STATE_HIT] * READY_N

        # The survivor's state still works: its pending store completes, its pin releases.
        done = survivor.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
            keys=list(own.keys_to_store), success=True, req_id="r", epoch=own.epoch,
            slot_offsets=list(own.slot_offsets)))
        assert done.completed == 1
        survivor.call("CompleteLoad", kvd_pb2.CompleteLoadRequest(keys=ready[7:8],
                                                                  epoch=held.epoch))
        doc = daemon.stats()
        assert doc["stats"]["pins"] == 0 and doc["blocks"]["storing"] == 0
        assert doc["blocks"]["pinned"] == 0 and doc["blocks"]["zombie"] == 0
        check_pool_identity(doc)
        universe = ready + keys_for("survivor-own", 1) + new_keys(f"{phase}-{how}")
        assert check_every_hit_is_whole(daemon.socket, universe) >= READY_N + 1
        # Slots the victim was writing stay quarantined while it may still write (a stopped
        # process can resume); once it is gone they come back: no slot is leaked.
        reap(victim, close=False)
        wait_until(lambda: daemon.stats()["pool"]["quarantined_slots"] == 0, SETTLE_S,
                   "the dead victim's quarantined slots to come back")
        check_no_slot_leaked(daemon.socket, daemon.stats())
        record("crash points")
        check_pool_identity(daemon.stats())
    finally:
        if victim is not None:
            reap(victim)
        survivor.close()
    assert "Traceback" not in daemon.log()


def test_stalled_writer_resuming_after_reap_cannot_corrupt_a_reused_slot(daemon):
    """SIGSTOP an engine mid-store until its session is reaped, let the freed slot be reused
    by another engine's completed store, then SIGCONT it so it finishes its (stale) write."""
    victim, said = start_victim(daemon.socket, "stale_writer", "stale")
    other = Engine(daemon.socket, MODEL, engine_id="other")
    try:
        (stale_offset,) = said["offsets"]
        os.kill(victim.pid, signal.SIGSTOP)
        wait_until(lambda: daemon.stats()["sessions"] == 1, SETTLE_S, "the stalled session reap")
        assert daemon.stats()["pool"]["quarantined_slots"] == 1
        grant = other.store(keys_for("reuser", 1))
        assert stale_offset not in grant.slot_offsets, "a quarantined slot was handed out"
        os.kill(victim.pid, signal.SIGCONT)
        assert victim.stdin is not None
        victim.stdin.write("go\n")
        victim.stdin.flush()
        assert json.loads(readline_within(victim, 10))["done"]
        (data,) = other.load(keys_for("reuser", 1))
        assert data == block_bytes_of(keys_for("reuser", 1)[0]), \
            "a READY block was overwritten by a reaped engine's late write"
        reap(victim, close=False)
        wait_until(lambda: daemon.stats()["pool"]["quarantined_slots"] == 0, SETTLE_S,
                   "the quarantined slot to come back once its writer is gone")
    finally:
        reap(victim)
        other.close()
