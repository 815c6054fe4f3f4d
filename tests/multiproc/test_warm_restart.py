"""Warm restart with real processes (restart.warm, kvd_server/restart/): a live engine carries
on across a daemon killed and started again (its blocks hit again without being stored again,
it lets go of what the new daemon held for it); a reader stopped in the middle of a load reads
its own bytes after the restart, and nothing is stored under it meanwhile; every reason to
start cold is said; what cannot be adopted is dropped, counted and never served."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kvd_client.offload.session import Lookup
from kvd_proto import kvd_pb2
from tests.support.daemon import HEARTBEAT, LIVENESS, PY, ROOT, clean_env
from tests.support.engine import Engine, keys_for
from tests.support.offload_engine import (
    EngineProcess,
    close_session,
    load,
    namespace,
    open_session,
    store,
)
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc
MODEL = "warm-model"
POOL = ("--pool-size", "8MiB", "--extent-size", "1MiB")        # 128 slots of 64 KiB
ENV = clean_env(KVD_MANAGER_HEARTBEAT_INTERVAL=HEARTBEAT, KVD_MANAGER_LIVENESS_TIMEOUT=LIVENESS,
                KVD_SERVER_DRAIN_TIMEOUT="5s")


@pytest.fixture
def state_dir(workdir: Path):
    path = Path("/dev/shm") / f"kvd-warm-{workdir.name}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(start_daemon, state: Path, *extra: str, socket: str | None = None):
    return start_daemon(*POOL, "--warm-restart", "--restart-dir", str(state), *extra,
                        env=ENV, socket=socket)


def _restart(start_daemon, daemon, state: Path, *extra: str):
    daemon.proc.kill()
    daemon.proc.wait(20)
    return _start(start_daemon, state, *extra, socket=daemon.socket)


def test_a_live_engine_carries_on_and_hits_again_without_storing_again(start_daemon,
                                                                       state_dir):
    daemon = _start(start_daemon, state_dir)
    a = open_session(daemon.socket, MODEL, reserve=16)
    keys = keys_for("carry-on", 40)
    try:
        for i in range(0, 40, 10):
            assert store(a, keys[i:i + 10]) is not None
        pool_id = a.client.pool_id
        daemon = _restart(start_daemon, daemon, state_dir)
        restart = daemon.stats()["restart"]
        assert restart["blocks_adopted"] == 40 and restart["previous_sessions"] == 1, restart
        # The engine reconnects by itself; its lookups hit again, byte for byte.
        wait_until(lambda: a.client.available and a.client.pool_id == pool_id
                   and (a.lookup(keys[0]) is Lookup.HIT or a.end_step()), 20,
                   "the engine to reconnect and find its blocks")
        a.end_step()
        states, bad = load(a, keys)
        assert states == [Lookup.HIT] * 40 and not bad
        # It said its old copies are done (none ran): nothing held for it any more.
        wait_until(lambda: not daemon.stats()["restart"]["held_sessions"], 10,
                   "the engine to let go of what the new daemon held for it", )
        doc = daemon.stats()
        assert namespace(doc, MODEL)["stores_started_total"] == 0, "stored again"
        assert store(a, keys_for("after-restart", 8)) is not None
    finally:
        close_session(a)


def test_a_reader_stopped_across_a_restart_reads_its_own_bytes(start_daemon, state_dir):
    """The issue-24 case, with warm restart: a reader looked up HITs and stalls before it
    copies; the daemon is killed and started again and a writer fills the pool meanwhile. The
    new daemon adopted the reader's blocks in their slots and holds every other slot for it:
    nothing is stored under it until it is done."""
    daemon = _start(start_daemon, state_dir)
    writer = open_session(daemon.socket, MODEL, reserve=16)
    reader: EngineProcess | None = None
    try:
        ready = keys_for("stalled", 8)
        assert store(writer, ready) is not None
        reader = EngineProcess(daemon.socket, MODEL)
        assert reader.ask("lookup", ready)["states"] == ["hit"] * 8
        offsets = set(reader.ask("pin", ready)["offsets"])
        reader.stop()
        daemon = _restart(start_daemon, daemon, state_dir)
        held = daemon.stats()["restart"]
        assert held["held_sessions"] == 2 and held["held_extents"] > 0, held
        # The writer reconnects (and lets go of its own hold: none of its copies ran) ...
        wait_until(lambda: _stepped(writer) and writer.available, 20,
                   "the writer to reconnect")
        wait_until(lambda: daemon.stats()["restart"]["held_sessions"] == 1, 10,
                   "the writer's old session to be let go")
        # ... and tries to fill the pool: nothing lands in the reader's slots (nothing at
        # all while the reader holds: every free slot waits for it).
        fill = keys_for("fill", 120)
        granted: list[int] = []
        for i in range(0, 120, 8):
            got = store(writer, fill[i:i + 8], stall_s=0.5)
            if got:
                granted += [o for _, o in got]
        assert not set(granted) & offsets, "a slot the stopped reader reads went to a store"
        assert not granted, "a slot was granted while the stopped reader held them all"
        reader.resume()
        assert reader.ask("read", ready)["match"] == [True] * 8
        reader.kill()
        wait_until(lambda: not daemon.stats()["restart"]["held_sessions"], 10,
                   "the reader's hold to go with its process",
                   detail=lambda: (daemon.stats()["restart"], daemon.log()[-2500:]))
        after = keys_for("fill-after", 64)
        for i in range(0, 64, 8):
            assert store(writer, after[i:i + 8], stall_s=10.0), "stores did not resume"
    finally:
        if reader is not None:
            reader.kill()
        close_session(writer)


def _stepped(session) -> bool:
    """One idle engine step (a reconnected session adopts its new connection in a step)."""
    session.lookup(b"no-such-key")
    session.end_step()
    return True


def test_every_reason_to_start_cold_is_said(start_daemon, state_dir, workdir):
    daemon = _start(start_daemon, state_dir)
    engine = Engine(daemon.socket, MODEL)
    assert len(engine.store(keys_for("cold", 8)).keys_to_store) == 8
    engine.call("CloseSession", kvd_pb2.CloseSessionRequest())
    engine.close()
    daemon = _restart(start_daemon, daemon, state_dir, "--cold")
    restart = daemon.stats()["restart"]
    assert restart["cold_reason"] == "kvd serve --cold" and restart["blocks_adopted"] == 0
    assert "starting cold, kvd serve --cold" in daemon.log()
    assert daemon.stats()["blocks"]["ready"] == 0

    engine = Engine(daemon.socket, MODEL)
    assert len(engine.store(keys_for("cold-2", 8)).keys_to_store) == 8
    engine.call("CloseSession", kvd_pb2.CloseSessionRequest())
    engine.close()
    daemon.proc.kill()
    daemon.proc.wait(20)
    daemon = start_daemon("--pool-size", "16MiB", "--extent-size", "1MiB", "--warm-restart",
                          "--restart-dir", str(state_dir), env=ENV, socket=daemon.socket)
    restart = daemon.stats()["restart"]
    assert restart["cold_reason"].startswith("pool.size changed"), restart
    assert "pool.size changed" in daemon.log()

    daemon.proc.kill()
    daemon.proc.wait(20)
    (state_dir / "state.json").write_text("{ torn")
    daemon = start_daemon("--pool-size", "16MiB", "--extent-size", "1MiB", "--warm-restart",
                          "--restart-dir", str(state_dir), env=ENV, socket=daemon.socket)
    assert "unreadable" in daemon.stats()["restart"]["cold_reason"]


def test_an_index_that_cannot_be_adopted_is_dropped_and_the_rest_served(start_daemon,
                                                                        state_dir):
    daemon = _start(start_daemon, state_dir)
    keep, lose = Engine(daemon.socket, "kept-model"), Engine(daemon.socket, "lost-model")
    kept, lost = keys_for("kept", 16), keys_for("lost", 16)
    assert len(keep.store(kept).keys_to_store) == 16
    assert len(lose.store(lost).keys_to_store) == 16
    lost_ns = lose.reg.namespace_id
    for e in (keep, lose):
        e.call("CloseSession", kvd_pb2.CloseSessionRequest())
        e.close()
    daemon.proc.kill()
    daemon.proc.wait(20)
    index = state_dir / f"index-{lost_ns}"
    with open(index, "r+b") as f:          # torn: shorter than its layout
        f.truncate(index.stat().st_size // 2)
    daemon = _start(start_daemon, state_dir, socket=daemon.socket)
    restart = daemon.stats()["restart"]
    assert restart["namespaces_adopted"] == 1 and restart["namespaces_dropped"] == 1, restart
    assert restart["blocks_adopted"] == 16
    assert "cannot be adopted" in daemon.log()
    keep, lose = Engine(daemon.socket, "kept-model"), Engine(daemon.socket, "lost-model")
    try:
        hit = kvd_pb2.BLOCK_STATE_HIT
        assert list(keep.lookup(kept).states) == [hit] * 16
        assert hit not in list(lose.lookup(lost).states)
        assert len(lose.store(lost).keys_to_store) == 16      # the namespace works again
    finally:
        for e in (keep, lose):
            e.call("CloseSession", kvd_pb2.CloseSessionRequest())
            e.close()
    metrics = daemon.stats()["restart"]
    assert json.dumps(metrics)                  # plain JSON in kvd stats --json
    text = daemon.kvd("stats").stdout
    assert "adopted" in text and "16 blocks in 1 namespaces" in text, text


def test_a_reset_before_the_restart_is_a_reset_after_it(start_daemon, state_dir):
    """kvd reset drops every block: the index a restarted daemon adopts shows none."""
    daemon = _start(start_daemon, state_dir)
    engine = Engine(daemon.socket, MODEL)
    assert len(engine.store(keys_for("reset", 8)).keys_to_store) == 8
    engine.call("CloseSession", kvd_pb2.CloseSessionRequest())
    engine.close()
    assert daemon.kvd("reset", "--yes").returncode == 0
    daemon = _restart(start_daemon, daemon, state_dir)
    restart = daemon.stats()["restart"]
    assert restart["adopted"] and restart["blocks_adopted"] == 0, restart
    assert not restart["cold_reason"]


def test_a_second_daemon_on_the_same_directory_is_refused(start_daemon, state_dir, workdir):
    first = _start(start_daemon, state_dir)
    proc = subprocess.run([PY, "-m", "kvd_server", "serve", "--socket",
                           str(workdir / "other.sock"), *POOL, "--warm-restart",
                           "--restart-dir", str(state_dir)], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "in use by another kvd daemon" in last and f"pid {first.proc.pid}" in last, last
    assert first.serving()


def _serve_fails(workdir: Path, *args: str, env: dict[str, str] = ENV) -> str:
    """`kvd serve ARGS` that must refuse to start (exit 1); its last line (the one that
    names the fix)."""
    proc = subprocess.run([PY, "-m", "kvd_server", "serve", "--socket",
                           str(workdir / "refused.sock"), *POOL, *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def test_a_restart_directory_on_a_disk_filesystem_is_refused(workdir):
    """The docs require memory (tmpfs or hugetlbfs) for restart.directory: on ext4 the pool's
    pages would be written to the disk as engines store blocks. The daemon refuses to start,
    naming the filesystem and why (it started without a word before)."""
    from tests.support import loopfs

    why_not = loopfs.unavailable("ext4")
    with contextlib.ExitStack() as stack:
        if why_not is None:                      # a real ext4, as the issue met
            fs = stack.enter_context(loopfs.mounted(workdir / "ext4", "ext4", 64 << 20))
            where, name = fs.path / "state", "ext4"
        else:                                    # else this test's own disk, if it is one
            from kvd_server.restart.state import MEMORY_FILESYSTEMS, filesystem_type

            if filesystem_type(str(workdir)) in MEMORY_FILESYSTEMS:
                pytest.skip(f"no disk filesystem to try: {why_not}, and {workdir} is memory")
            where, name = workdir / "state", ""
        last = _serve_fails(workdir, "--warm-restart", "--restart-dir", str(where))
        assert f"restart.directory: {where} is on {name}" in last, last
        assert "not on memory (tmpfs or hugetlbfs)" in last and "written to the disk" in last
        assert "/dev/shm/kvd" in last, last


def test_a_systemd_store_outside_systemd_names_restart_store(workdir):
    """restart.store = "systemd" without systemd: the refusal names restart.store, the
    setting at fault, not restart.directory (which it is not using)."""
    env = dict(ENV, KVD_RESTART_STORE="systemd")
    last = _serve_fails(workdir, "--warm-restart", env=env)
    assert 'restart.store = "systemd" needs the daemon to run as a systemd service' in last
    assert "restart.directory" not in last, last
