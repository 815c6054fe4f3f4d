"""Fair share of a pool filled by a fast-path engine, with a real daemon and real engines.

An engine that maps its namespace's index (the fast path) makes every slot the daemon frees in
that namespace wait in limbo until the engine's published epoch has moved past it. A second
namespace that needs room takes a whole extent from the first (fair share): the extent's
blocks are evicted at once, but the extent can change hands only once its slots have left
limbo. What must hold: the second namespace's PrepareStore / Grant / StoreGranted are never
answered INTERNAL; while the extent drains they get what room there is ("cannot store", fewer
slots), its retries evict nothing more, and once the first engine's epoch moves the extent
goes to the namespace it was taken for, which then stores and reads back its own bytes while
the first engine's remaining blocks stay intact.

`KVD_SOAK_FAIR_S` sets the length of the soak variant (`make soak`).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from kvd_client.offload.session import Lookup, OffloadSession
from kvd_proto import kvd_pb2
from tests.support.daemon import PY, ROOT, clean_env
from tests.support.engine import Engine, block_bytes_of, keys_for
from tests.support.offload_engine import (
    EngineProcess,
    close_session,
    load,
    namespace,
    open_session,
    settle,
    store,
)
from tests.support.summary import record
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc
POOL = ("--pool-size", "16MiB", "--extent-size", "4MiB")   # 4 extents x 64 slots of 64 KiB
PER_EXTENT = 64
SOAK_S = float(os.environ.get("KVD_SOAK_FAIR_S", "30"))


def _fill(a: OffloadSession, seed: str, n: int) -> list[bytes]:
    """Store `n` blocks through the fast path, 16 a step; the keys stored."""
    keys = keys_for(seed, n)
    for i in range(0, n, 16):
        assert store(a, keys[i:i + 16]) is not None
    return keys


def _step(b: Engine, op: kvd_pb2.StepOp) -> kvd_pb2.StepResult:
    return b.call("Step", kvd_pb2.StepRequest(ops=[op])).results[0]


def _grant(b: Engine, count: int, evict: bool = False) -> list[int]:
    return list(_step(b, kvd_pb2.StepOp(grant=kvd_pb2.GrantRequest(
        count=count, evict=evict))).grant.slot_offsets)


def _store_granted(b: Engine, keys: list[bytes], offsets: list[int]
                   ) -> kvd_pb2.StoreGrantedResponse:
    for key, offset in zip(keys, offsets, strict=True):
        b.write(offset, block_bytes_of(key))
    answer = _step(b, kvd_pb2.StepOp(store_granted=kvd_pb2.StoreGrantedRequest(
        keys=keys, req_id="g", granted_keys=keys, granted_offsets=offsets))).store_granted
    b.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
        keys=keys, success=True, req_id="g", epoch=answer.epoch, slot_offsets=offsets))
    return answer


def _extents(daemon) -> dict[str, int]:
    return {ns["model"]: ns["extents"] for ns in daemon.stats()["namespaces"]}


def _evictions(daemon, model: str) -> int:
    return namespace(daemon.stats(), model)["evictions_total"]


class _Asker:
    """The second namespace's engine (gRPC only) asking for room one way: `try_once` makes
    one attempt and returns the keys it stored (none while no room is free)."""

    def __init__(self, b: Engine, how: str) -> None:
        self.b, self.how = b, how
        self.keys = iter(keys_for(f"b-{how}", 100_000))
        self.stored: list[bytes] = []
        self.granted: list[int] = []

    def prepare(self) -> None:
        """store_granted: hold a whole extent granted before the pool fills, so its stores
        (which evict for the reserve they leave owed) are what asks for more room."""
        if self.how == "store_granted":
            self.granted = _grant(self.b, PER_EXTENT)
            assert len(self.granted) == PER_EXTENT

    def try_once(self) -> list[bytes]:
        b = self.b
        if self.how == "prepare_store":
            grant = b.store([next(self.keys) for _ in range(8)])
            done = list(grant.keys_to_store)
            assert grant.cannot_store == (not done)
        elif self.how == "grant_evict":
            offsets = _grant(b, 8, evict=True)
            done = [next(self.keys) for _ in offsets]
            if done:
                answer = _store_granted(b, done, offsets)
                assert answer.accepted == len(done), answer
        else:
            offsets, self.granted = self.granted, []
            if not offsets:
                offsets = _grant(b, 8)
            done = [next(self.keys) for _ in offsets]
            if done:
                answer = _store_granted(b, done, offsets)
                assert answer.accepted == len(done), answer
        self.stored += done
        return done


@pytest.mark.parametrize("how", ["prepare_store", "grant_evict", "store_granted"])
def test_a_namespace_takes_its_share_from_a_fast_path_engine_without_internal(start_daemon,
                                                                              how):
    daemon = start_daemon(*POOL)
    b = Engine(daemon.socket, model="b")
    asker = _Asker(b, how)
    asker.prepare()
    a = open_session(daemon.socket, "a", reserve=16)
    try:
        held_b = _extents(daemon).get("b", 0)
        a_keys = _fill(a, "a", (4 - held_b) * PER_EXTENT - 16)    # the rest of the pool
        assert _extents(daemon) == {"a": 4 - held_b, "b": held_b}
        evicted = _evictions(daemon, "a")       # its reserve grew: it evicted its own
        resident = namespace(daemon.stats(), "a")["blocks"]["ready"]
        # The engine is mid-step: the epoch it published holds every slot freed from now on.
        assert a.lookup(a_keys[-1]) is Lookup.HIT
        for _ in range(5):
            try:
                asker.try_once()
            except grpc.RpcError as exc:
                pytest.fail(f"{how} answered {exc.code().name}: {exc.details()}")
        # One extent's blocks evicted for it, not one extent per try.
        assert _evictions(daemon, "a") == evicted + PER_EXTENT
        assert _extents(daemon)["b"] == held_b
        a.end_step()               # no load in flight: the engine holds nothing any more
        wait_until(lambda: asker.try_once(), 10, f"{how} to get room once the extent drained")
        assert _extents(daemon) == {"a": 3 - held_b, "b": held_b + 1}
        assert _evictions(daemon, "a") == evicted + PER_EXTENT
        got = b.load(asker.stored[-8:])
        assert got == [block_bytes_of(k) for k in asker.stored[-8:]]
        states, bad = load(a, a_keys)
        assert bad == [] and states.count(Lookup.HIT) == resident - PER_EXTENT
        settle(a)
    finally:
        close_session(a)
        b.close()
    assert "Traceback" not in daemon.log()


# --- another tenant (another uid), and the soak variant ---------------------------------------

UID_B = 60021
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as "
                                                          "another uid")


def _tenant_daemon(start_daemon, workdir: Path):
    """A daemon every uid may reach, with UID_B mapped to tenant team-b."""
    os.chmod(workdir, 0o755)
    sockdir = workdir / "s"
    sockdir.mkdir()
    os.chmod(sockdir, 0o777)
    env = clean_env(KVD_SERVER_SOCKET_MODE="0666", KVD_MANAGER_HEARTBEAT_INTERVAL="200ms",
                    KVD_MANAGER_LIVENESS_TIMEOUT="1s", KVD_TENANTS_UIDS=f"{UID_B}=team-b")
    return start_daemon(*POOL, env=env, socket=str(sockdir / "kvd.sock"))


def _asker(sock: str, mode: str, arg: float, seed: str, *, wait: bool = True
           ) -> dict | subprocess.Popen[str]:
    """The second namespace's engine as uid UID_B in its own process (see `_asker_main`)."""
    argv = [PY, "-m", "tests.multiproc.test_fair_share", str(UID_B), sock, mode, str(arg), seed]
    if not wait:
        return subprocess.Popen(argv, env=clean_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT)
    out = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_root
def test_another_tenant_gets_the_extent_once_the_fast_path_engine_moved_on(start_daemon,
                                                                          workdir):
    """The extent changes tenant (its pages move to the other tenant's pool file) only once
    the engine that may still read it has published a newer epoch."""
    daemon = _tenant_daemon(start_daemon, workdir)
    a = open_session(daemon.socket, "a", reserve=16)
    try:
        a_keys = _fill(a, "a", 4 * PER_EXTENT - 16)
        evicted = _evictions(daemon, "a")
        resident = namespace(daemon.stats(), "a")["blocks"]["ready"]
        assert a.lookup(a_keys[-1]) is Lookup.HIT          # mid-step
        first = _asker(daemon.socket, "tries", 5, "tenant-b")
        assert first["tenant"] == "team-b" and first["errors"] == [], first
        assert first["stored"] == 0 and first["cannot"] == 5
        assert _evictions(daemon, "a") == evicted + PER_EXTENT
        a.end_step()
        second = _asker(daemon.socket, "until", 10, "tenant-b2")
        assert second["errors"] == [] and second["stored"] == 8 and second["match"], second
        assert _extents(daemon) == {"a": 3, "b": 1}
        assert daemon.stats()["tenants"]["team-b"]["used_bytes"] == 4 << 20
        states, bad = load(a, a_keys)
        assert bad == [] and states.count(Lookup.HIT) == resident - PER_EXTENT
        settle(a)
    finally:
        close_session(a)


@needs_root
@pytest.mark.soak
def test_two_tenants_share_a_pool_under_a_busy_fast_path_engine(start_daemon, workdir):
    """An engine of one tenant stores and loads through the fast path without pause (loads
    in flight at most steps) while an engine of another tenant stores through gRPC for
    KVD_SOAK_FAIR_S seconds: no call fails, each ends with its fair share of the pool, and
    every byte either reads back is its own."""
    daemon = _tenant_daemon(start_daemon, workdir)
    a = EngineProcess(daemon.socket, "a", reserve=16)
    b = None
    try:
        stored: list[bytes] = []
        new = iter(keys_for("soak-a", 1_000_000))
        for _ in range(4 * PER_EXTENT // 16):              # fill the pool first
            keys = [next(new) for _ in range(16)]
            assert len(a.ask("store", keys)["granted"]) == 16
            stored += keys
        b = _asker(daemon.socket, "for", SOAK_S, "soak-b", wait=False)
        rng = random.Random(7)
        steps = 0
        deadline = time.monotonic() + SOAK_S
        while time.monotonic() < deadline or b.poll() is None:
            keys = [next(new) for _ in range(16)]
            stored += [bytes.fromhex(k) for k, _ in a.ask("store", keys)["granted"]]
            answer = a.ask("load", rng.sample(stored[-512:], 16))
            assert answer["bad"] == [], "the busy engine read another block's bytes"
            steps += 1
            if time.monotonic() > deadline + 60:
                pytest.fail("the other tenant's engine did not finish")
        out, err = b.communicate(timeout=30)
        assert b.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        record("fair share steps", steps)
        assert result["errors"] == [] and result["match"], result
        assert result["stored"] > 0
        assert _extents(daemon) == {"a": 2, "b": 2}
    finally:
        if b is not None and b.poll() is None:
            b.kill()
            b.wait(10)
        a.close()
    assert "INTERNAL" not in daemon.log()


def _asker_main(argv: list[str]) -> int:
    """`UID SOCKET MODE ARG SEED`: drop to UID, register model "b", then store 8 new blocks
    at a time: `tries N` (N attempts), `until S` (until one is stored, at most S seconds) or
    `for S` (S seconds), reading back what each store wrote. Prints one JSON line: tenant,
    stored, cannot (attempts answered "cannot store"), errors, match."""
    uid, sock, mode, arg, seed = int(argv[0]), argv[1], argv[2], float(argv[3]), argv[4]
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    e = Engine(sock, "b", engine_id=f"fair-share-{uid}")
    keys = iter(keys_for(seed, 1_000_000))
    out: dict = {"tenant": e.info.tenant, "stored": 0, "cannot": 0, "errors": [],
                 "match": True}
    deadline = time.monotonic() + arg
    tries = 0
    try:
        while True:
            tries += 1
            try:
                grant = e.store([next(keys) for _ in range(8)])
                done = list(grant.keys_to_store)
                if done:
                    states = list(e.lookup(done).states)
                    hits = [k for k, s in zip(done, states) if s == kvd_pb2.BLOCK_STATE_HIT]
                    data = e.load(hits)
                    out["match"] &= data == [block_bytes_of(k) for k in hits]
            except grpc.RpcError as exc:
                out["errors"].append(f"{exc.code().name}: {exc.details()}")
                done = []
            out["stored"] += len(done)
            out["cannot"] += not done
            if mode == "tries" and tries >= arg or mode == "until" and done \
                    or mode != "tries" and time.monotonic() > deadline:
                break
            if not done:
                time.sleep(0.01)
    finally:
        e.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_asker_main(sys.argv[1:]))
