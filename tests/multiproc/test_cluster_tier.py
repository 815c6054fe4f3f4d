"""The cluster tier on a real Mooncake store (one master on loopback) under real daemons: an
engine on daemon A stores blocks, an engine on daemon B (its own pool and socket) finds them
(HIT_PENDING, then HIT) and loads them byte-exact; another tenant never sees them; the master
killed and restarted mid-run costs MISSes only: both daemons keep serving, the tier says it
is degraded, then recovers by itself and shares again."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvd_client.offload.session import Lookup, OffloadSession
from tests.support import mooncake
from tests.support.daemon import HEARTBEAT, LIVENESS, POOL, PY, ROOT, Daemon, clean_env
from tests.support.engine import block_bytes_of, keys_for
from tests.support.offload_engine import (
    close_session,
    count_blocking_calls,
    open_session,
    read_back,
    read_block,
    store,
)
from tests.support.promotion import read_back_promoted
from tests.support.waits import wait_until

pytestmark = [pytest.mark.multiproc,
              pytest.mark.skipif(bool(mooncake.unavailable()), reason=mooncake.unavailable())]
MODEL = "cluster-model"
SHARED = 48                 # blocks A stores and B reads back
DEADLINE_S = 0.5            # an engine's call deadline (the client's default)
PUT_OUTCOMES = ("demotions_total", "demotions_refused_total", "failures_total")


def _env(master: mooncake.Master, node: str, **extra: str) -> dict[str, str]:
    settings = dict(KVD_MANAGER_HEARTBEAT_INTERVAL=HEARTBEAT,
                    KVD_MANAGER_LIVENESS_TIMEOUT=LIVENESS, KVD_SERVER_DRAIN_TIMEOUT="5s",
                    KVD_TIERS_CLUSTER_MASTER=master.address,
                    KVD_TIERS_CLUSTER_METADATA_URL=master.metadata_url,
                    KVD_TIERS_CLUSTER_LOCAL_HOSTNAME="127.0.0.1",
                    KVD_TIERS_CLUSTER_SEGMENT_SIZE="64MiB",
                    KVD_TIERS_CLUSTER_BUFFER_SIZE="16MiB",
                    KVD_TIERS_CLUSTER_SIZE="256MiB",
                    KVD_TIERS_CLUSTER_SYNC_INTERVAL="200ms",
                    KVD_TIERS_CLUSTER_RETRY_INTERVAL="1s",
                    KVD_TIERS_CLUSTER_NODE_ID=node)
    return clean_env(**{**settings, **extra})


def _tier(daemon) -> dict:
    """The daemon's cluster tier entry of `kvd stats` (with a disk tier too, the promotions
    and held-below counts are on the disk's entry)."""
    return {t["name"]: t for t in daemon.stats()["tiers"]}["cluster"]




def _daemon(start_daemon, workdir: Path, master: mooncake.Master, node: str, pool: str = POOL,
            **extra: str):
    daemon = start_daemon("--pool-size", pool, "--extent-size", "4MiB",
                          env=_env(master, node, **extra), socket=str(workdir / f"{node}.sock"))
    wait_until(lambda: _tier(daemon)["health"] == "ok", 30, f"{node}'s cluster tier to connect")
    return daemon


@contextlib.contextmanager
def _two_nodes(start_daemon, workdir: Path, master: mooncake.Master
               ) -> Iterator[tuple[Daemon, Daemon, OffloadSession, OffloadSession]]:
    """Daemons A and B on the master, an engine on each (the writer on A, the reader on B)."""
    a = _daemon(start_daemon, workdir, master, "node-a")
    b = _daemon(start_daemon, workdir, master, "node-b")
    writer = open_session(a.socket, MODEL, reserve=64)
    reader = open_session(b.socket, MODEL, reserve=16)
    try:
        yield a, b, writer, reader
    finally:
        close_session(writer)
        close_session(reader)


def _published(daemon, n: int, since: int = 0) -> None:
    """Wait until the daemon has published n blocks more than `since` (its demotions then)."""
    wait_until(lambda: _tier(daemon)["demotions_total"] >= since + n and
               _tier(daemon)["queue_depth"] == 0, 30, f"{n} blocks published")


def _agent_pid(daemon: Daemon) -> int:
    """The pid of the daemon's store agent (its child running the store's client)."""
    def find() -> int:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    cmd = (entry / "cmdline").read_bytes()
                    if int(stat[1]) == daemon.proc.pid and b"store_agent_main" in cmd \
                            and stat[0] != "Z":
                        return int(entry.name)
        return 0
    return wait_until(find, 30, "the daemon's store agent")


def _all_hit_within(session: OffloadSession, keys: Sequence[bytes], seconds: float) -> bool:
    """Look `keys` up step after step (every HIT the writer's bytes) until all are HITs
    (True) or `seconds` pass (False: some never named here, or lost)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if set(_never_wrong(session, keys)) == {Lookup.HIT}:
            return True
        time.sleep(0.02)
    return False


def _never_unreachable(caplog) -> None:
    """No engine lost its daemon: the daemons answered their heartbeats all along."""
    lost = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert lost == [], f"an engine lost its daemon: {lost}"


def _asked(session: OffloadSession, daemon, keys: Sequence[bytes]) -> None:
    """Look `keys` up, step after step (the engine asks the store about them with its step;
    keys it found absent lately are asked again a second later), until the daemon names
    them held below (the store held them)."""
    def found() -> bool:
        [session.lookup(k) for k in keys]
        session.end_step()
        return _tier(daemon)["below_keys"] >= len(keys)

    wait_until(found, 30, f"{len(keys)} blocks of the other node to be found here",
               detail=lambda: _tier(daemon))


def _shared(session: OffloadSession, daemon, keys: Sequence[bytes]) -> None:
    """Read `keys` (another node's) back through HIT_PENDING and HIT, byte-exact: the first
    lookup asks the store (not known yet: the session's pending answer), the next ones
    find them held below."""
    first, bad = read_back_promoted(session, keys)
    assert bad == [], f"{len(bad)} blocks from the cluster loaded with wrong bytes"
    assert all(first[k] is Lookup.HIT_PENDING for k in keys), \
        "a block only the cluster held did not answer HIT_PENDING first"


def _never_wrong(session: OffloadSession, keys: Sequence[bytes]) -> list[Lookup]:
    """Look `keys` up; every HIT must load the writer's bytes."""
    states = [session.lookup(k) for k in keys]
    hits = [k for k, s in zip(keys, states, strict=True) if s is Lookup.HIT]
    offsets = session.start_loads(hits)
    pool = session.client.pool
    wrong = [k for k, o in zip(hits, offsets, strict=True)
             if o is None or read_block(pool, o) != block_bytes_of(k)]
    session.finish_loads(hits)
    session.end_step()
    assert wrong == [], f"{len(wrong)} HITs served wrong bytes"
    return states


def test_a_block_stored_on_one_node_is_found_and_loaded_on_another(start_daemon, workdir,
                                                                  master):
    with _two_nodes(start_daemon, workdir, master) as (a, b, writer, reader):
        keys = keys_for("cluster", SHARED)
        assert Lookup.HIT not in {reader.lookup(k) for k in keys}    # asked: none anywhere
        reader.end_step()
        store(writer, keys)
        _published(a, SHARED)
        # What each tier holds, in bytes too (it said 0 while it knew SHARED blocks): a's
        # published blocks, b's once its engine's lookups found them (before any promotion).
        block = a.stats()["namespaces"][0]["block_bytes"]
        _asked(reader, b, keys)
        for daemon in (a, b):
            tier = _tier(daemon)
            assert tier["blocks"] == SHARED and tier["used_bytes"] == SHARED * block, tier
            assert f"{SHARED} blocks, {SHARED * block >> 20}MiB" in daemon.kvd("stats").stdout
        first, bad = read_back_promoted(reader, keys)     # promoted from the store
        assert bad == [] and set(first.values()) <= {Lookup.HIT_PENDING, Lookup.HIT}
        tier = _tier(b)
        assert tier["promotions_total"] >= SHARED and tier["corrupt_total"] == 0
        assert b.stats()["stats"]["hits_total"] >= SHARED

    # Another tenant (uid mapped to team-b on daemon C: another namespace for the same model
    # and layout) never sees them, however long it waits.
    c = _daemon(start_daemon, workdir, master, "node-c",
                KVD_TENANTS_UIDS=f"{os.getuid()}=team-b")
    other = open_session(c.socket, MODEL, reserve=16)
    try:
        wait_until(lambda: _tier(c)["health"] == "ok", 10, "node-c's tier")
        seen = set()
        for _ in range(10):                           # two seconds: asked, found nothing
            seen.update(_never_wrong(other, keys))
            time.sleep(0.2)
        assert Lookup.HIT not in seen and Lookup.MISS in seen
        tier = _tier(c)
        assert tier["found_total"] == 0 and tier["find_calls_total"] >= 1, tier
        assert tier["below_keys"] == 0 and tier["promotions_total"] == 0
    finally:
        close_session(other)


def test_a_block_is_found_at_the_first_step_after_its_first_lookup(start_daemon, workdir,
                                                                   master):
    """The store is its own directory, asked on demand: B's engine looks A's blocks up (not
    known yet: RETRY), the daemon asks the store about the step's keys in one batched call,
    and at B's next step they answer HIT_PENDING (held below: promoted), then HIT,
    byte-exact. No exchange between the nodes (their sync interval is a minute here)."""
    a = _daemon(start_daemon, workdir, master, "node-a", KVD_TIERS_CLUSTER_SYNC_INTERVAL="60s")
    b = _daemon(start_daemon, workdir, master, "node-b", KVD_TIERS_CLUSTER_SYNC_INTERVAL="60s")
    writer = open_session(a.socket, MODEL, reserve=64)
    reader = open_session(b.socket, MODEL, reserve=16,
                          answers=(Lookup.MISS, Lookup.HIT, Lookup.HIT_PENDING, "retry"))
    try:
        keys = keys_for("on-demand", SHARED)
        store(writer, keys)
        _published(a, SHARED)
        before = _tier(b)
        assert before["blocks"] == 0 and before["below_keys"] == 0   # nothing learned unasked
        started = time.monotonic()
        assert [reader.lookup(k) for k in keys] == ["retry"] * SHARED
        reader.end_step()                             # its FIND goes with the step
        wait_until(lambda: _tier(b)["below_keys"] >= SHARED, 10, "the store's answer",
                   interval=0.002, detail=lambda: _tier(b))
        found_in = time.monotonic() - started
        assert [reader.lookup(k) for k in keys] == [Lookup.HIT_PENDING] * SHARED   # next step
        reader.end_step()
        tier = _tier(b)
        assert tier["find_calls_total"] - before["find_calls_total"] == 1, tier
        assert tier["found_total"] == SHARED and tier["finds_total"] == SHARED, tier
        assert found_in < 5, f"the store's answer took {found_in:.2f}s"
        first, bad = read_back_promoted(reader, keys)
        assert bad == [], f"{len(bad)} blocks from the cluster loaded with wrong bytes"
        assert _tier(b)["promotions_total"] >= SHARED
        # Keys no node published: asked once, then MISS (absent, not asked again for a while)
        absent = keys_for("nowhere", 8)
        assert {reader.lookup(k) for k in absent} == {"retry"}
        reader.end_step()
        wait_until(lambda: _tier(b)["find_calls_total"] > tier["find_calls_total"], 10,
                   "the store's answer about absent keys")
        for _ in range(20):
            states = {reader.lookup(k) for k in absent}
            reader.end_step()
            if states == {Lookup.MISS}:
                break
            time.sleep(0.01)
        assert states == {Lookup.MISS}
        calls = _tier(b)["find_calls_total"]
        for _ in range(5):
            assert {reader.lookup(k) for k in absent} == {Lookup.MISS}
            reader.end_step()
        assert _tier(b)["find_calls_total"] == calls          # remembered absent
    finally:
        close_session(writer)
        close_session(reader)


def test_an_engine_on_the_call_protocol_finds_them_too(start_daemon, workdir, master):
    """A gRPC `Lookup` on B of A's blocks answers MISS at once and asks the store in the
    background; the next `Lookup` finds them held below (HIT_PENDING: promoted), then HIT,
    each block byte-exact."""
    from kvd_proto import kvd_pb2
    from tests.support.engine import Engine

    with _two_nodes(start_daemon, workdir, master) as (a, b, writer, _reader):
        keys = keys_for("call-path", 8)
        store(writer, keys)
        _published(a, len(keys))
        engine = Engine(b.socket, MODEL)
        try:
            hit, miss = kvd_pb2.BLOCK_STATE_HIT, kvd_pb2.BLOCK_STATE_MISS
            assert list(engine.lookup(keys).states) == [miss] * len(keys)
            wait_until(lambda: _tier(b)["below_keys"] >= len(keys), 10,
                       "the store's answer", detail=lambda: _tier(b))
            assert kvd_pb2.BLOCK_STATE_HIT_PENDING in engine.lookup(keys).states
            wait_until(lambda: list(engine.lookup(keys).states) == [hit] * len(keys), 30,
                       "the promotions")
            answer = engine.lookup(keys, lease_ms=2000)
            assert list(answer.states) == [hit] * len(keys)
            for key, offset in zip(keys, answer.slot_offsets, strict=True):
                assert engine.read(offset) == block_bytes_of(key)
            assert _tier(b)["promotions_total"] >= len(keys)
        finally:
            engine.close()


def test_a_master_killed_and_restarted_costs_misses_only(start_daemon, workdir, master,
                                                         caplog):
    """...and never stalls a daemon: Mooncake's client holds the GIL while it sets up
    against a master that is down, so it runs in each daemon's store agent, and the engines'
    heartbeats are answered throughout."""
    with _two_nodes(start_daemon, workdir, master) as (a, b, writer, reader):
        before = keys_for("before", 16)
        store(writer, before)
        _published(a, 16)
        _asked(reader, b, before)

        master.stop()
        for daemon in (a, b):
            wait_until(lambda d=daemon: _tier(d)["health"] == "degraded", 60,
                       "the tier to report the master gone")
            health = daemon.kvd("health")
            assert health.returncode == 0, health.stderr       # the daemon serves
            assert "tier cluster: NOT_SERVING" in health.stdout, health.stdout
        # Both keep serving from their pools: A stores and reads its own blocks back.
        during = keys_for("during", 16)
        store(writer, during)
        assert set(_never_wrong(writer, during)) == {Lookup.HIT}
        _never_wrong(reader, before)                  # MISS (or a HIT of the right bytes)

        master.start()                                # back, empty
        for daemon in (a, b):
            wait_until(lambda d=daemon: _tier(d)["health"] == "ok", 60,
                       "the tier to recover by itself")
        _never_wrong(reader, before)
        after = keys_for("after", 16)
        published = _tier(a)["demotions_total"]
        store(writer, after)
        _published(a, 16, since=published)
        _shared(reader, b, after)
    _never_unreachable(caplog)


def test_a_master_killed_under_load_leaves_no_engine_step_unanswered(start_daemon, workdir,
                                                                       master, caplog):
    """Engines on both nodes store, look up and find steadily while the master is SIGKILLed:
    every step's round trip to either daemon (`flush`, the client's deadline 0.5 s) is
    answered in time, before, during and after the tier degrades."""
    with _two_nodes(start_daemon, workdir, master) as (a, b, writer, reader):
        killed_at = time.monotonic() + 1.5
        end = killed_at + 5.0
        late = worst = 0.0
        steps = 0
        n = 0
        while time.monotonic() < end:
            if master.proc is not None and time.monotonic() >= killed_at:
                master.stop()                         # SIGKILL, mid-load
            keys = keys_for(f"load-{n}", 8)
            n += 1
            store(writer, keys, wait=False)
            for k in keys_for(f"load-{max(0, n - 3)}", 8):   # A's blocks of a few steps ago
                reader.lookup(k)
            reader.end_step()
            for session in (writer, reader):
                t0 = time.perf_counter()
                answered = session.client.flush(deadline_s=DEADLINE_S)
                took = time.perf_counter() - t0
                worst = max(worst, took)
                late += not answered
                steps += 1
            time.sleep(0.01)
        assert late == 0, f"{late} of {steps} steps unanswered within {DEADLINE_S}s " \
                          f"(worst {worst:.2f}s)"
        for daemon in (a, b):
            assert _tier(daemon)["health"] == "degraded", _tier(daemon)
            assert daemon.kvd("health").returncode == 0
    _never_unreachable(caplog)


def test_a_store_agent_killed_costs_misses_only(start_daemon, workdir, master, caplog):
    """The store's client crashing (its agent SIGKILLed, as a fault in native code would end
    it): the daemon serves on, its tier degrades, starts a new agent by itself and shares
    again; nothing wrong is served meanwhile."""
    with _two_nodes(start_daemon, workdir, master) as (a, b, writer, reader):
        before = keys_for("before", 16)
        store(writer, before)
        _published(a, 16)
        _asked(reader, b, before)
        old = _agent_pid(b)
        os.kill(old, signal.SIGKILL)
        seen = set()
        for _ in range(200):                    # b's engine reads on: right bytes or MISS
            seen.update(_never_wrong(reader, before))
            if _tier(b)["health"] == "degraded":
                break
            time.sleep(0.01)
        assert seen <= {Lookup.HIT, Lookup.HIT_PENDING, Lookup.MISS}
        wait_until(lambda: _tier(b)["health"] == "ok" and _agent_pid(b) != old, 60,
                   "b's tier to start a new agent")
        # Until the master drops B's old segment, blocks placed on it are lost (A's puts
        # may fail, B's reads MISS): publish batches until one is read back whole.
        for attempt in range(20):
            after = keys_for(f"after-{attempt}", 16)
            was = _tier(a)
            store(writer, after)
            wait_until(lambda w=was: _tier(a)["queue_depth"] == 0 and
                       sum(_tier(a)[k] - w[k] for k in PUT_OUTCOMES) >= 16, 30,
                       "a's publications to be made, refused or failed",
                       detail=lambda w=was: (w, _tier(a)))
            if _tier(a)["demotions_total"] >= was["demotions_total"] + 16 and \
                    _all_hit_within(reader, after, 15):
                break
            time.sleep(0.5)
        else:
            raise AssertionError("b never read a whole batch of a's blocks again")
        assert b.kvd("health").returncode == 0
    _never_unreachable(caplog)


def test_a_node_leaving_costs_only_misses(start_daemon, workdir, master):
    """Daemon A stops (drains, its client leaves the store with its segment): B, reading A's
    blocks, gets each one byte-exact or a MISS (what only A's segment held), serves on, and
    its tier stays healthy."""
    with _two_nodes(start_daemon, workdir, master) as (a, b, writer, reader):
        keys = keys_for("leaving", 32)
        store(writer, keys)
        _published(a, len(keys))
        _asked(reader, b, keys)
        a.close()
        seen: dict[bytes, Lookup] = {}
        for _ in range(2000):                       # until no key is pending any more
            states = _never_wrong(reader, keys)
            seen.update(zip(keys, states, strict=True))
            if Lookup.HIT_PENDING not in states:
                break
            time.sleep(0.005)
        else:
            raise AssertionError("promotions of the leaving node's blocks never ended")
        assert set(seen.values()) <= {Lookup.HIT, Lookup.MISS}
        assert _tier(b)["health"] == "ok"
        mine = keys_for("b-own", 8)                 # b serves on: stores and hits
        store(reader, mine)
        assert set(_never_wrong(reader, mine)) == {Lookup.HIT}


def test_a_disk_tier_over_the_cluster_store(start_daemon, workdir, master):
    """Daemon A has both tiers (kvd_server/tiers/stack.py): what its pool evicts goes to its
    disk and comes back from there; daemon B (the cluster tier only) reads the same blocks
    from the store; A reports each tier apart."""
    a = _daemon(start_daemon, workdir, master, "node-a",
                KVD_TIERS_DISK_PATH=str(workdir / "disk-a"), KVD_TIERS_DISK_SIZE="64MiB",
                KVD_TIERS_DISK_EXTENT_SIZE="4MiB", pool="16MiB")
    b = _daemon(start_daemon, workdir, master, "node-b")
    tiers = {t["name"]: t for t in a.stats()["tiers"]}
    assert set(tiers) == {"disk", "cluster"}
    writer = open_session(a.socket, MODEL, reserve=32)
    reader = open_session(b.socket, MODEL, reserve=16)
    try:
        keys = keys_for("stacked", 384)              # 1.5x A's pool (256 blocks)
        for i in range(0, len(keys), 32):
            store(writer, keys[i:i + 32])
        wait_until(lambda: {t["name"]: t for t in a.stats()["tiers"]}["disk"]["blocks"] > 0
                   and all(t["queue_depth"] == 0 for t in a.stats()["tiers"]), 30,
                   "A's evictions to reach its disk")
        evicted = keys[:64]                          # the oldest: on A's disk now
        first, bad = read_back_promoted(writer, evicted)
        assert bad == [] and Lookup.HIT_PENDING in set(first.values())
        first, bad = read_back_promoted(reader, keys[-64:])
        assert bad == [], f"{len(bad)} blocks from the store loaded with wrong bytes"
        health = a.kvd("health")
        assert health.returncode == 0 and "NOT_SERVING" not in health.stdout, health.stdout
    finally:
        close_session(writer)
        close_session(reader)


def test_a_hung_master_never_slows_the_scheduler(start_daemon, workdir, master):
    """The master stopped (SIGSTOP: a store that answers nothing, the worst kind of slow):
    B's engine looks A's blocks up with no call to the daemon on its thread; a promotion
    waits on the tier's threads until its deadline and then reads MISS, never wrong bytes;
    once the master runs again the tier serves again."""
    with _two_nodes(start_daemon, workdir, master) as (a, b, writer, reader):
        keys = keys_for("hung", 16)
        store(writer, keys)
        _published(a, len(keys))
        _asked(reader, b, keys)
        calls = count_blocking_calls(reader.client)
        os.kill(master.proc.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60
            while True:                          # pending until the promotions give up
                states = _never_wrong(reader, keys)
                if Lookup.HIT_PENDING not in states:
                    break
                assert time.monotonic() < deadline, "promotions never ended"
                time.sleep(0.01)
            assert calls[0] == 0, f"{calls[0]} calls to the daemon on the scheduler thread"
            mine = keys_for("b-own", 8)          # b serves on from its pool meanwhile
            store(reader, mine)
            assert set(_never_wrong(reader, mine)) == {Lookup.HIT}
        finally:
            os.kill(master.proc.pid, signal.SIGCONT)
        wait_until(lambda: _tier(b)["health"] == "ok", 60, "b's tier to serve again")
        # The master kept its state: each tier recovered with its own client (its segment
        # never remounted for it). What the paused master dropped meanwhile (Mooncake expires
        # clients it has not heard from) reads MISS, never wrong bytes; new blocks are shared.
        wait_until(lambda: _tier(a)["health"] == "ok", 60, "a's tier to serve again")
        for daemon in (a, b):
            assert daemon.log().count("connected to the store") == 1, daemon.log()[-3000:]
        _never_wrong(reader, keys)
        for attempt in range(10):
            after = keys_for(f"after-hang-{attempt}", 8)
            published = _tier(a)["demotions_total"]
            store(writer, after)
            _published(a, len(after), since=published)
            if _all_hit_within(reader, after, 10):
                break
        else:
            raise AssertionError("b never read a's new blocks after the hang")


OTHER_UID = 60031
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run an engine as "
                                                          "another uid (another tenant)")


@needs_root
def test_another_tenant_on_the_same_daemon_never_sees_them(start_daemon, workdir, master):
    """On daemon B, an engine of another uid (tenant team-b), same model and layout, looks up
    the blocks A's engine (the default tenant) published: MISS, however long it waits, while
    B's engine of the default tenant reads them."""
    os.chmod(workdir, 0o755)
    sockdir = workdir / "s"
    sockdir.mkdir()
    os.chmod(sockdir, 0o777)
    a = _daemon(start_daemon, workdir, master, "node-a")
    b = start_daemon("--pool-size", POOL, "--extent-size", "4MiB", socket=str(sockdir / "b.sock"),
                     env=_env(master, "node-b", KVD_SERVER_SOCKET_MODE="0666",
                              KVD_TENANTS_UIDS=f"{OTHER_UID}=team-b"))
    wait_until(lambda: _tier(b)["health"] == "ok", 30, "b's cluster tier to connect")
    writer = open_session(a.socket, MODEL, reserve=64)
    reader = open_session(b.socket, MODEL, reserve=16)
    try:
        keys = keys_for("tenants", 16)
        store(writer, keys)
        _published(a, len(keys))
        _shared(reader, b, keys)                     # the same tenant on B: found
        other = subprocess.Popen([PY, "-m", "tests.multiproc.test_cluster_tier",
                                  str(OTHER_UID), b.socket, *[k.hex() for k in keys]],
                                 env=clean_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            # While it looks up (2 s), its namespace is team-b's (once its session ends, an
            # empty namespace is forgotten at the next sweep).
            wait_until(lambda: {ns["tenant"] for ns in b.stats()["namespaces"]
                                if ns["model"] == MODEL} == {"default", "team-b"}, 30,
                       "the other uid's engine to register as tenant team-b")
            stdout, stderr = other.communicate(timeout=120)
        finally:
            if other.poll() is None:
                other.kill()
                other.communicate()
        assert other.returncode == 0, stderr[-3000:]
        result = json.loads(stdout.strip().splitlines()[-1])
        # asked the store about them (pending while asked), found nothing: never a HIT
        assert "hit" not in result and result["miss"] >= 8 * len(keys), result
    finally:
        close_session(writer)
        close_session(reader)


@pytest.mark.skipif(bool(mooncake.netns_unavailable()), reason=mooncake.netns_unavailable())
def test_a_store_that_cannot_set_up_names_its_own_error(workdir):
    """A node whose only network is loopback (a container without a LAN address): Mooncake's
    client cannot set up, answers a bare -1, and logs why ("not valid LAN address found")
    among hundreds of lines. The master is up, so the tier's reason names the store's own
    error, bounded, not a guess about the master; `kvd health` and `kvd stats` show it whole."""
    with mooncake.loopback_netns() as enter:
        master = mooncake.Master(workdir, enter=enter)
        master.start()
        sock = str(workdir / "lan.sock")
        env = _env(master, "node-lan")
        log_path = workdir / "lan.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([*enter, PY, "-m", "kvd_server", "serve", "--socket", sock,
                                     "--pool-size", POOL, "--extent-size", "4MiB"], env=env,
                                    stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        daemon = Daemon(socket=sock, proc=proc, log_path=log_path, env=env)
        try:
            wait_until(daemon.serving, 30, "the daemon to serve")
            reason = wait_until(
                lambda: (lambda t: t["reason"] if "LAN address" in t["reason"] else None)(
                    _tier(daemon)), 60, "the tier to name Mooncake's error",
                detail=lambda: (_tier(daemon), daemon.log()[-3000:]))
            assert "Mooncake's set-up failed (code -1" in reason, reason
            assert "not valid LAN address found [transfer_engine_impl.cpp:" in reason, reason
            assert "is the master" not in reason and len(reason) < 1000, reason
            assert _tier(daemon)["health"] == "degraded"
            health = daemon.kvd("health")
            assert health.returncode == 0, health.stderr
            (line,) = [x for x in health.stdout.splitlines() if x.startswith("tier cluster")]
            assert line.startswith("tier cluster: NOT_SERVING (degraded: Mooncake's set-up "
                                   "failed"), line
            assert "not valid LAN address found" in line, line
            text = daemon.kvd("stats").stdout
            assert "".join(reason.split()) in "".join(text.split()), text
            assert all(len(x) <= 80 for x in text.splitlines()), text
            assert "not valid LAN address found" in daemon.log()     # passed on, as before
        finally:
            daemon.close()
            master.stop()


def _other_tenant_main(argv: list[str]) -> int:
    """`UID SOCKET KEY_HEX...`: drop to UID, open an engine session, look the keys up in 10
    steps 0.2 s apart; print the answers' counts as one JSON line."""
    uid, sock, keys = int(argv[0]), argv[1], [bytes.fromhex(k) for k in argv[2:]]
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    session = open_session(sock, MODEL, reserve=4)
    counts: dict[str, int] = {}
    try:
        for _ in range(10):
            for state in (session.lookup(k) for k in keys):
                counts[state.value] = counts.get(state.value, 0) + 1
            session.end_step()
            time.sleep(0.2)
    finally:
        close_session(session)
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(_other_tenant_main(sys.argv[1:]))


def test_a_store_that_fills_up_is_not_a_fault(start_daemon, workdir, master):
    """Steady publication into a store smaller than what is published: the puts it has no
    room for are refused one by one (counted), the tier never degrades, its client and
    segment are never recycled (the blocks it holds stay readable from another node), and
    promotions go on."""
    a = _daemon(start_daemon, workdir, master, "node-a",
                KVD_TIERS_CLUSTER_SEGMENT_SIZE="16MiB")
    b = _daemon(start_daemon, workdir, master, "node-b",
                KVD_TIERS_CLUSTER_SEGMENT_SIZE="16MiB")
    writer = open_session(a.socket, MODEL, reserve=64)
    reader = open_session(b.socket, MODEL, reserve=16)
    try:
        early = keys_for("early", 32)
        store(writer, early)
        _published(a, 32)
        keys = keys_for("fill", 1200)                     # ~75 MiB into 32 MiB of segments
        for i in range(0, len(keys), 32):
            store(writer, keys[i:i + 32])
            assert _tier(a)["health"] == "ok", _tier(a)
        wait_until(lambda: _tier(a)["queue_depth"] == 0, 30, "the puts to end")
        tier = _tier(a)
        assert tier["health"] == "ok" and tier["store_full_total"] > 0, tier
        assert tier["failures_total"] == 0, tier
        assert a.log().count("connected to the store") == 1     # never recycled
        assert a.log().count("the store is full") <= 3          # one line per interval
        # B reads every block back, byte-exact where the store holds it (it evicts by itself
        # when full, and refused some puts: a MISS then, never a wrong byte); promotions go
        # on. Which ones the store kept follows its own eviction and leases: counted only.
        loaded, missed = read_back(reader, early + keys)
        assert loaded >= 32, (loaded, missed, _tier(a), _tier(b))
        assert _tier(b)["promotions_total"] >= loaded and _tier(b)["health"] == "ok"
        assert _tier(a)["health"] == "ok"
    finally:
        close_session(writer)
        close_session(reader)
