"""File-backed pools (`pool.backing = "file"`) against a real daemon, real engine processes.

Two things must hold. A file cannot be sealed the way the default memfd is, so an engine
holding its descriptor could `ftruncate` it under every other engine of the node (their next
copy dies of SIGBUS, or reads zeros): engines of a uid other than the daemon's (and root's),
started here as uids 60001 and 60002, are refused the descriptor, while a memfd pool's seals
make the same truncate fail. And a daemon SIGKILLed and restarted on the same `pool.path` never
stores into the file a stalled reader of the previous daemon still copies from: that copy
reads the bytes it looked up.

Run as a module, this file is the hostile engine (`python -m tests.multiproc.test_file_pool
truncate UID SOCKET ROLE shrink|regrow`: it drops to UID, attaches, truncates its descriptor
and prints what happened as one JSON line) or a daemon run as another uid (`serve-as UID
ARGS...`). `KVD_SOAK_ROUNDS` sets the soak variants' rounds (10 in `make soak`).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd_client.attach import AttachError, attach
from tests.support.as_user import drop
from tests.support.client import run_client
from tests.support.daemon import PY, ROOT, Daemon, clean_env, spawn_daemon
from tests.support.engine import Engine, keys_for
from tests.support.offload_engine import EngineProcess
from tests.support.summary import record
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc
MODEL = "file-pool-model"
SMALL = ("--pool-size", "8MiB", "--extent-size", "2MiB")      # 128 slots of 64 KiB
LARGE = ("--pool-size", "64MiB", "--extent-size", "4MiB")     # 1024 slots
SOAK_ROUNDS = max(1, int(os.environ.get("KVD_SOAK_ROUNDS", "10")) // 10)
HOSTILE = (60001, 60002)
RESERVE = 4                                                  # an engine process's reserve
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run engines as "
                                                          "other uids")


@pytest.fixture
def pool_dir() -> Iterator[Path]:
    """A directory for the pool file on tmpfs (where operators put it), removed at the end."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = Path(tempfile.mkdtemp(prefix="kvd-pool-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def daemon_env(persist: bool = False) -> dict[str, str]:
    return clean_env(KVD_MANAGER_HEARTBEAT_INTERVAL="200ms", KVD_MANAGER_LIVENESS_TIMEOUT="1s",
                     KVD_SERVER_DRAIN_TIMEOUT="5s",
                     KVD_POOL_PERSIST="true" if persist else "false")


def file_args(pool_dir: Path, size: tuple[str, ...] = SMALL) -> tuple[str, ...]:
    return (*size, "--pool-backing", "file", "--pool-path", str(pool_dir))


# --- an engine of another uid truncating its descriptor ---------------------------------------


def hostile(uid: int, sock: str, role: str, how: str) -> dict:
    out = subprocess.run([PY, "-m", "tests.multiproc.test_file_pool", "truncate", str(uid),
                          sock, role, how], env=clean_env(), capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def as_user(uid: int, sock: str, *args: str) -> dict:
    """tests/support/as_user.py as `uid`: its one JSON line."""
    out = subprocess.run([PY, "-m", "tests.support.as_user", str(uid), str(uid), sock, *args],
                         env=clean_env(), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def honest_load(sock: str, seed: str, n: int) -> None:
    """An engine process of the daemon's tenant loads `n` blocks and checks every byte."""
    out = run_client(sock, "load", MODEL, seed, str(n))
    assert out.returncode == 0, (
        f"the honest engine died (exit {out.returncode}; -7 is SIGBUS): {out.stderr[-2000:]}")
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["match"], f"the honest engine loaded wrong bytes: {doc}"


def shared_daemon(workdir: Path, *args: str, env: dict[str, str]) -> Daemon:
    """A daemon whose sockets every uid may open (as on a node where engines run as others)."""
    os.chmod(workdir, 0o755)
    sockdir = workdir / "s"
    sockdir.mkdir(exist_ok=True)
    os.chmod(sockdir, 0o777)
    return spawn_daemon(workdir, *args, env={**env, "KVD_SERVER_SOCKET_MODE": "0666"},
                        socket=str(sockdir / "kvd.sock"))


def check_truncate_attempt(backing: str, answer: dict) -> None:
    """A file-backed pool is refused to another uid, with an error saying why and what to do;
    a memfd pool is handed out and its seals refuse the truncate."""
    if backing == "file":
        assert not answer["attached"], f"another uid got the file-backed pool: {answer}"
        assert answer["code"] == "FAILED_PRECONDITION", answer
        assert "pool.backing" in answer["error"] and "memfd" in answer["error"], answer
    else:
        assert answer["attached"] and not answer["truncated"], answer
        assert answer["errno"] == "EPERM", answer


@needs_root
@pytest.mark.parametrize("backing,how", [("file", "shrink"), ("file", "regrow"),
                                         ("memfd", "shrink")])
def test_another_uid_cannot_truncate_the_pool_under_an_honest_engine(workdir, pool_dir,
                                                                     backing, how):
    args = file_args(pool_dir) if backing == "file" else SMALL
    daemon = shared_daemon(workdir, *args, env=daemon_env())
    try:
        sock = daemon.socket
        stored = json.loads(run_client(sock, "store", MODEL, "honest", "32").stdout)
        assert stored["stored"] == 32
        # An honest engine mapped the pool and pinned blocks it is about to copy.
        keys = keys_for("honest", 32)
        reader, _ = pinned_reader(sock, keys, stop=False)
        try:
            answers = [hostile(HOSTILE[0], sock, role, how) for role in ("dataplane", "engine")]
            try:
                match = reader.ask("read", keys)["match"]
            except AssertionError as exc:
                reader.proc.wait(10)
                raise AssertionError(f"the honest engine died copying (exit "
                                     f"{reader.proc.returncode}; -7 is SIGBUS): {exc}") from None
            assert match == [True] * 32, f"{match.count(False)} of 32 copies read wrong bytes"
        finally:
            reader.kill()
        honest_load(sock, "honest", 32)               # and a new engine maps and loads
        for answer in answers:
            check_truncate_attempt(backing, answer)
        if backing == "file":
            assert daemon.stats()["sessions"] == 0, "a refused attach left a session behind"
    finally:
        daemon.close()
    assert "Traceback" not in daemon.log(), daemon.log()


@needs_root
@pytest.mark.soak
@pytest.mark.parametrize("round_", range(SOAK_ROUNDS))
def test_truncate_attempts_between_honest_loads_soak(workdir, pool_dir, round_):
    """Many hostile attempts (both roles, shrink and regrow, two uids) between honest loads
    and stores on a larger pool: every load reads its own bytes, no honest engine dies."""
    rng = random.Random(round_)
    daemon = shared_daemon(workdir, *file_args(pool_dir, LARGE), env=daemon_env())
    try:
        sock = daemon.socket
        for i in range(8):
            seed = f"soak-{round_}-{i}"
            assert json.loads(run_client(sock, "store", MODEL, seed, "64").stdout)["stored"] == 64
            answer = hostile(rng.choice(HOSTILE), sock, rng.choice(("dataplane", "engine")),
                             rng.choice(("shrink", "regrow")))
            honest_load(sock, seed, 64)
            check_truncate_attempt("file", answer)
            record("isolation checks")
    finally:
        daemon.close()
    assert "Traceback" not in daemon.log(), daemon.log()


DAEMON_UID = 60005


@needs_root
def test_a_daemon_not_run_as_root_hands_its_pool_file_to_its_own_uid_only(workdir, pool_dir):
    """The daemon runs as uid 60005: engines of 60005 and root attach and load their bytes,
    an engine of 60001 is refused with a message naming pool.backing and memfd."""
    os.chmod(workdir, 0o755)
    sockdir = workdir / "s"
    sockdir.mkdir()
    os.chmod(sockdir, 0o777)
    os.chown(pool_dir, DAEMON_UID, DAEMON_UID)
    sock = str(sockdir / "kvd.sock")
    log_path = workdir / "kvd.log"
    env = {**daemon_env(), "KVD_SERVER_SOCKET_MODE": "0666"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([PY, "-m", "tests.multiproc.test_file_pool", "serve-as",
                                 str(DAEMON_UID), "--socket", sock, *file_args(pool_dir)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    daemon = Daemon(socket=sock, proc=proc, log_path=log_path, env=env)
    try:
        wait_until(daemon.serving, 30, "the daemon of uid 60005 to serve")
        assert os.stat(pool_dir / "kvd-pool").st_uid == DAEMON_UID
        own = as_user(DAEMON_UID, sock, "engine", MODEL, "own", "16", "own")
        assert own["stored"] == 16 and own["own_match"], own
        assert json.loads(run_client(sock, "store", MODEL, "root", "16").stdout)["stored"] == 16
        honest_load(sock, "root", 16)
        for role in ("dataplane", "engine"):
            check_truncate_attempt("file", hostile(HOSTILE[0], sock, role, "shrink"))
        honest_load(sock, "root", 16)
    finally:
        daemon.close()
    assert "Traceback" not in daemon.log(), daemon.log()


# --- a stalled reader across a daemon restart ---------------------------------------------------


def pinned_reader(sock: str, keys: list[bytes], stop: bool) -> tuple[EngineProcess, set[int]]:
    """An engine process that looked `keys` up (all HITs) and pinned them, and has not copied
    yet: stopped (SIGSTOP) with `stop`, else just holding its mapping."""
    reader = EngineProcess(sock, MODEL, reserve=RESERVE)
    try:
        assert reader.ask("lookup", keys)["states"] == ["hit"] * len(keys)
        offsets = reader.ask("pin", keys)["offsets"]
        assert None not in offsets and len(set(offsets)) == len(keys), offsets
        if stop:
            reader.stop()
    except BaseException:
        reader.kill()
        raise
    return reader, set(offsets)


def fill_pool(sock: str, seed: str, capacity: int) -> tuple[set[int], str]:
    """Store as many new blocks as the pool holds, 128 at a time: every slot of the new daemon
    is written (but a few a live reader's session may hold in its reserve). The offsets
    written and the pool id the filling engine was handed."""
    engine = Engine(sock, MODEL, engine_id="filler")
    try:
        written: set[int] = set()
        keys = keys_for(seed, capacity)
        for i in range(0, capacity, 128):
            grant = engine.store(keys[i:i + 128])
            assert not grant.cannot_store and len(grant.keys_to_store) == len(keys[i:i + 128])
            written |= set(grant.slot_offsets)
        return written, engine.info.pool_id
    finally:
        engine.close()


def restart_round(start_daemon, pool_dir: Path, persist: bool, stop: bool, seed: str,
                  size: tuple[str, ...], n: int, capacity: int, restarts: int = 1) -> None:
    """Store `n` blocks, pin them in a reader, SIGKILL and restart the daemon `restarts`
    times on the same pool.path filling the whole pool each time, then let the reader copy."""
    env = daemon_env(persist)
    daemon = start_daemon(*file_args(pool_dir, size), env=env)
    sock = daemon.socket
    writer = Engine(sock, MODEL, engine_id="writer")
    keys = keys_for(f"{seed}-ready", n)
    assert len(writer.store(keys).keys_to_store) == n
    pool_ids = [writer.info.pool_id]
    writer.close()
    reader, offsets = pinned_reader(sock, keys, stop)
    try:
        for i in range(restarts):
            daemon.proc.kill()
            daemon.proc.wait(20)
            daemon = start_daemon(*file_args(pool_dir, size), env=env, socket=sock)
            written, pool_id = fill_pool(sock, f"{seed}-fill-{i}", capacity)
            # The test means something only if the new daemon's slots cover the reader's (a
            # reader left running may reconnect and hold a few in its reserve).
            missed = offsets - written
            assert len(missed) <= (0 if stop else RESERVE), \
                f"the fill did not cover {len(missed)} of the stalled reader's slots"
            pool_ids.append(pool_id)
        if stop:
            reader.resume()
        match = reader.ask("read", keys)["match"]
        assert match == [True] * n, (
            f"{match.count(False)} of {n} copies of the stalled reader read another key's bytes")
        # The reader's file was never adopted (the kernel knew it was mapped): every daemon
        # after it had another id, so clients map the new memory instead of keeping the old.
        assert pool_ids[0] not in pool_ids[1:], f"the reader's pool id came back: {pool_ids}"
        record("stall checks")
    finally:
        reader.kill()
    if persist:
        # With no process holding the file any more, a clean restart keeps what persist
        # promises: the same file (its memory) and the same pool id.
        inode = os.stat(pool_dir / "kvd-pool").st_ino
        assert (pool_dir / "kvd-pool.id").read_text().strip() == pool_ids[-1]
        assert daemon.terminate() == 0
        again = start_daemon(*file_args(pool_dir, size), env=env, socket=sock)
        engine = Engine(again.socket, MODEL, engine_id="after")
        try:
            assert engine.info.pool_id == pool_ids[-1]
            assert os.stat(pool_dir / "kvd-pool").st_ino == inode
        finally:
            engine.close()


@pytest.mark.parametrize("persist", [False, True], ids=["no-persist", "persist"])
def test_a_stalled_reader_of_a_killed_daemon_copies_its_own_bytes(start_daemon, pool_dir,
                                                                  persist):
    restart_round(start_daemon, pool_dir, persist, stop=True, seed=f"stall-{persist}",
                  size=SMALL, n=16, capacity=128)


@pytest.mark.soak
@pytest.mark.parametrize("round_", range(SOAK_ROUNDS))
@pytest.mark.parametrize("stop", [True, False], ids=["stopped", "holding"])
@pytest.mark.parametrize("persist", [False, True], ids=["no-persist", "persist"])
def test_stalled_readers_across_daemon_restarts_soak(start_daemon, pool_dir, persist, stop,
                                                    round_):
    """256 pinned blocks of a reader that survives two restarts, each filling a 64 MiB pool."""
    restart_round(start_daemon, pool_dir, persist, stop=stop, seed=f"soak-{persist}-{round_}",
                  size=LARGE, n=256, capacity=1024, restarts=2)


# --- what this file runs as a module -----------------------------------------------------------


def _serve_as_main(argv: list[str]) -> int:
    """`serve-as UID ARGS...`: `kvd serve ARGS...` as UID (imported first: the interpreter
    may not be readable by UID)."""
    import grpc_health.v1.health  # noqa: F401

    import kvd_server.server
    import kvd_server.units  # noqa: F401
    from kvd_server.cli import main as cli

    drop(int(argv[1]), int(argv[1]))
    return cli.main(["serve", *argv[2:]])


def _truncate_main(argv: list[str]) -> int:
    """`truncate UID SOCKET ROLE shrink|regrow`: attach as UID, ftruncate the pool to 0 (and
    with `regrow` back to its size), print {"attached", "truncated", "errno", "code",
    "error"}."""
    uid, sock, role, how = int(argv[1]), argv[2], argv[3], argv[4]
    drop(uid, uid)
    try:
        info = attach(sock, role=role, engine_id=f"hostile-{uid}", timeout=5.0)
    except AttachError as exc:
        print(json.dumps({"attached": False, "code": exc.code, "error": str(exc)}), flush=True)
        return 0
    out: dict = {"attached": True, "truncated": False, "errno": ""}
    try:
        os.ftruncate(info.fd, 0)
        out["truncated"] = True
        if how == "regrow":
            os.ftruncate(info.fd, info.pool_bytes)
    except OSError as exc:
        out["errno"] = errno.errorcode.get(exc.errno or 0, str(exc))
    finally:
        os.close(info.fd)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_serve_as_main(sys.argv[1:]) if sys.argv[1] == "serve-as"
             else _truncate_main(sys.argv[1:]))
