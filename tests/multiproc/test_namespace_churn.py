"""Namespace churn against a real daemon, with engines running as another uid.

Every namespace has a shared index sized for the whole pool (36 MiB for a 1 GiB pool of 4 KiB
blocks with 128-byte keys). An engine process that opens namespace after namespace (a new
model, layout or salt each time), maps each index once and exits must not leave them behind:
a namespace with no session and no block is forgotten as soon as its last session has ended
(and no reader's process may still read its slots; `tenants.namespace_idle_timeout` may delay
it) and its index closed, and a tenant holds at most `tenants.max_namespaces` at once and
`tenants.max_index_memory` bytes of indexes (the next namespace is refused RESOURCE_EXHAUSTED,
naming the setting), whatever the other tenants do.

What is measured is what the system pays: the daemon's open memory files (/proc/PID/fd), the
namespaces `kvd stats --json` lists and, in the soak variant, the node's Shmem
(/proc/meminfo). `KVD_SOAK_CHURN_ROUNDS` sets the soak variant's rounds (`make soak`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from kvd_client.client import KvdClient
from kvd_client.offload.session import Lookup, OffloadSession
from kvd_proto import kvd_pb2
from kvd_proto.wire import KvLayout
from tests.support.daemon import PY, ROOT, clean_env
from tests.support.engine import Engine, keys_for
from tests.support.processes import readline_within, reap
from tests.support.summary import record
from tests.support.waits import wait_until

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run clients as other uids"),
]

CHURNER, OTHER = 60031, 60032
BLOCK = 4096
KEY_BYTES = 128
INDEX_BYTES = 36 << 20              # 262,144 slots of 4 KiB x (128 + 16) bytes, and a header
INDEX_FILE = INDEX_BYTES + 4096     # an index's file, header included
SOAK_ROUNDS = int(os.environ.get("KVD_SOAK_CHURN_ROUNDS", "10"))


def _daemon(start_daemon, workdir: Path, **settings: str):
    """A 1 GiB pool (not pre-faulted: only the indexes' memory is at stake) every uid may
    reach, CHURNER mapped to tenant churn and OTHER to tenant other."""
    os.chmod(workdir, 0o755)
    sockdir = workdir / "s"
    sockdir.mkdir()
    os.chmod(sockdir, 0o777)
    env = clean_env(KVD_SERVER_SOCKET_MODE="0666", KVD_MANAGER_HEARTBEAT_INTERVAL="200ms",
                    KVD_MANAGER_LIVENESS_TIMEOUT="1s", KVD_POOL_PREFAULT="false",
                    KVD_TENANTS_UIDS=f"{CHURNER}=churn,{OTHER}=other", **settings)
    return start_daemon("--pool-size", "1GiB", "--extent-size", "64MiB", env=env,
                        socket=str(sockdir / "kvd.sock"))


def _indexes(daemon) -> list[int]:
    """The sizes of the namespace indexes the daemon holds open (its kvd-index memfds; a
    mapping holds a descriptor of its own, so one file may show up twice)."""
    files = {}
    for fd in Path(f"/proc/{daemon.proc.pid}/fd").iterdir():
        try:
            if "kvd-index-" in os.readlink(fd):
                st = os.stat(fd)
                files[st.st_dev, st.st_ino] = st.st_size
        except OSError:
            continue                       # closed meanwhile
    return sorted(files.values())


def _as(uid: int, sock: str, action: str, prefix: str, n: int, hold: bool = False) -> dict:
    argv = [PY, "-m", "tests.multiproc.test_namespace_churn", str(uid), sock, action, prefix,
            str(n), "hold" if hold else "exit"]
    out = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


class _Live:
    """An engine process of another uid that has done its part (`first`: its JSON line) and
    keeps its sessions until `finish` (then it ends them as its action says, and exits)."""

    def __init__(self, uid: int, sock: str, action: str, prefix: str, n: int) -> None:
        argv = [PY, "-m", "tests.multiproc.test_namespace_churn", str(uid), sock, action,
                prefix, str(n), "wait"]
        self.stderr = tempfile.TemporaryFile("w+")   # noqa: SIM115 - closed by close()
        self.proc = subprocess.Popen(argv, env=clean_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     cwd=ROOT)
        try:
            self.first: dict = json.loads(readline_within(self.proc, 60, self.stderr))
        except BaseException:
            self.close()
            raise

    def finish(self) -> float:
        """Let it end; when it had exited (monotonic time)."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            rc = self.proc.wait(30)
            exited = time.monotonic()
            self.stderr.seek(0)
            assert rc == 0, self.stderr.read()
            return exited
        finally:
            self.close()

    def close(self) -> None:
        reap(self.proc)
        self.stderr.close()


def _namespaces(daemon, tenant: str) -> int:
    return sum(ns["tenant"] == tenant for ns in daemon.stats()["namespaces"])


def _memfd_names(daemon) -> list[str]:
    """The daemon's open descriptors of memory files (its pool, indexes, marks and channels;
    a Python mapping holds a descriptor of its own), by name: what a leaked namespace keeps
    open."""
    names = []
    for fd in Path(f"/proc/{daemon.proc.pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue                       # closed meanwhile
        if link.startswith("/memfd:"):
            names.append(link)
    return sorted(names)


def _memfds(daemon) -> int:
    return len(_memfd_names(daemon))


def _shmem() -> int:
    """The node's shared memory in use (/proc/meminfo Shmem), bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no Shmem line in /proc/meminfo")


def _kvd_stats(daemon) -> dict:
    """`kvd stats --json`, as an operator reads it."""
    out = daemon.kvd("stats", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _churn_and_measure(daemon, n: int, action: str) -> tuple[int, int, int, float]:
    """One process of CHURNER maps `n` namespaces (`action`: `map` closes each session,
    `map-exit` keeps them all open and exits without ending any): (the daemon's memfds
    before, and with the process still there, the node's Shmem then, when it exited). Its
    tenant's pool file (one per tenant, made at its first attach) is there before: an attach
    without a namespace first."""
    assert _as(CHURNER, daemon.socket, "map", "first", 0)["tenant"] == "churn"
    before = _memfds(daemon)
    live = _Live(CHURNER, daemon.socket, action, "leak", n)
    try:
        assert live.first["opened"] == n and live.first["tenant"] == "churn", live.first
        during, shmem = _memfds(daemon), _shmem()
    finally:
        exited = live.finish()
    return before, during, shmem, exited


def _wait_gone(daemon, before: int, exited: float, what: str) -> None:
    """Within 3 s of the engine process's exit: the daemon's memfds back to `before` and no
    namespace of the churning tenant left."""
    wait_until(lambda: _memfds(daemon) <= before and _namespaces(daemon, "churn") == 0,
               max(0.1, exited + 3.0 - time.monotonic()), what,
               detail=lambda: f"memfds {_memfd_names(daemon)} (before {before}), "
                              f"namespaces {_namespaces(daemon, 'churn')}")


def test_an_empty_namespace_goes_with_its_last_session(start_daemon, workdir):
    """The default configuration: 8 namespaces, each one session of another uid that maps and
    reads its index and closes. Within 3 s of the process's exit the daemon holds none of them
    (before: all 8 stayed for a minute, 2 memory files each)."""
    daemon = _daemon(start_daemon, workdir)
    before, _, _, exited = _churn_and_measure(daemon, 8, "map")
    _wait_gone(daemon, before, exited,
               "the empty namespaces' indexes to close with their last session")
    doc = _kvd_stats(daemon)
    assert [ns for ns in doc["namespaces"] if ns["tenant"] == "churn"] == []
    assert doc["index_memory"]["tenants"]["churn"]["bytes"] == 0, doc["index_memory"]
    assert not _indexes(daemon)
    record("churn namespaces", 8)


def test_an_engine_gone_without_closing_leaves_no_namespace(start_daemon, workdir):
    """The same churn by a process that keeps every session open and exits (its streams break
    with it): once the daemon sees the process gone, the readers' grace is over and the 8
    empty namespaces go too."""
    daemon = _daemon(start_daemon, workdir)
    before, during, _, exited = _churn_and_measure(daemon, 8, "map-exit")
    assert during >= before + 8, (before, during)   # its 8 indexes were all open at once
    _wait_gone(daemon, before, exited, "the namespaces of an engine that exited to go")


def test_a_tenant_holds_at_most_its_index_memory(start_daemon, workdir):
    """`tenants.max_index_memory` bounds the bytes of indexes a tenant's namespaces hold at
    once: the namespace past it is refused RESOURCE_EXHAUSTED naming the setting, `kvd stats`
    counts the bytes, and the other tenant is not held back."""
    limit = 3 * INDEX_FILE + INDEX_FILE // 2
    daemon = _daemon(start_daemon, workdir, KVD_TENANTS_MAX_INDEX_MEMORY=str(limit))
    held = _Live(CHURNER, daemon.socket, "register", "held", 4)
    try:
        assert held.first["opened"] == 3, held.first
        code, message = held.first["refused"]
        assert code == "RESOURCE_EXHAUSTED", held.first
        assert "tenants.max_index_memory" in message and "'churn'" in message, message
        tenants = _kvd_stats(daemon)["index_memory"]["tenants"]
        assert tenants["churn"] == {"bytes": 3 * INDEX_FILE, "limit_bytes": limit,
                                    "refused_total": 1}, tenants
        other = _as(OTHER, daemon.socket, "register", "other", 4)
        assert other["opened"] == 4 and other["refused"] is None, other
    finally:
        held.finish()
    # Its sessions gone, its namespaces are empty: the bytes are free for new ones.
    again = _as(CHURNER, daemon.socket, "register", "again", 3)
    assert again["opened"] == 3 and again["refused"] is None, again


def test_namespaces_an_engine_churned_through_are_forgotten_once_idle(start_daemon, workdir):
    daemon = _daemon(start_daemon, workdir, KVD_TENANTS_NAMESPACE_IDLE_TIMEOUT="1s")
    out = _as(CHURNER, daemon.socket, "map", "churn", 40)
    assert out["opened"] == 40 and out["tenant"] == "churn", out
    record("churn namespaces", 40)
    # Every one of them was mapped: 40 indexes of 36 MiB each existed, all empty.
    wait_until(lambda: not _indexes(daemon) and _namespaces(daemon, "churn") == 0, 15,
               "the idle namespaces to be forgotten and their indexes closed")
    assert "forgot" in daemon.log()
    # Forgetting one loses nothing: the same model comes back as a new, working namespace.
    again = _as(CHURNER, daemon.socket, "store", "churn", 1)
    assert again["opened"] == 1 and again["stored"] == 8 and again["hits"] == 8, again
    # One that holds blocks is no idle one: it stays (its blocks outlive the engine).
    wait_until(lambda: _namespaces(daemon, "churn") == 1 and len(_indexes(daemon)) == 1, 5,
               "the namespace holding blocks to stay")
    assert _indexes(daemon) == [INDEX_FILE]


def test_a_tenant_holds_at_most_its_namespace_limit(start_daemon, workdir):
    daemon = _daemon(start_daemon, workdir, KVD_TENANTS_MAX_NAMESPACES="8",
                     KVD_TENANTS_NAMESPACE_IDLE_TIMEOUT="1h")
    held = _as(CHURNER, daemon.socket, "register", "held", 9, hold=True)
    assert held["opened"] == 8, held
    code, message = held["refused"]
    assert code == "RESOURCE_EXHAUSTED", held
    assert "tenants.max_namespaces = 8" in message and "'churn'" in message, message
    # The other tenant is not held back by it.
    other = _as(OTHER, daemon.socket, "register", "other", 8)
    assert other["opened"] == 8 and other["refused"] is None, other
    # The churner's process is gone: its 8 empty namespaces make room at once for new ones,
    # long before their idle timeout.
    again = _as(CHURNER, daemon.socket, "register", "again", 8)
    assert again["opened"] == 8 and again["refused"] is None, again
    # Namespaces holding blocks count: with 8 of them, a ninth is refused.
    full = _as(CHURNER, daemon.socket, "store", "full", 9)
    assert full["opened"] == 8 and full["refused"][0] == "RESOURCE_EXHAUSTED", full
    assert _namespaces(daemon, "churn") == 8
    assert len(_indexes(daemon)) == _namespaces(daemon, "churn") + _namespaces(daemon, "other")


@pytest.mark.soak
def test_namespace_churn_soak_gives_the_shared_memory_back(start_daemon, workdir):
    """40 namespaces of 36 MiB indexes mapped and read by another uid, in the default
    configuration: 3 s after the process exited the daemon's memory files and namespaces are
    back where they were, and so is the node's Shmem (before: +1,440 MiB)."""
    daemon = _daemon(start_daemon, workdir)
    for round_, action in enumerate(("map", "map-exit")):
        shmem = _shmem()
        before, _, during, exited = _churn_and_measure(daemon, 40, action)
        if action == "map-exit":       # 40 indexes read at once: the node paid for them
            assert during - shmem > 20 * INDEX_BYTES, f"Shmem grew {(during - shmem) >> 20} MiB"
        _wait_gone(daemon, before, exited, f"round {round_} ({action}): the namespaces to go")
        # Other processes of the node move Shmem too: allow a tenth of what 40 leaked.
        grown = _shmem() - shmem
        assert grown < 4 * INDEX_BYTES, f"round {round_}: Shmem grew {grown >> 20} MiB"
        record("churn namespaces", 40)


@pytest.mark.soak
def test_namespace_churn_soak_leaves_nothing_behind(start_daemon, workdir):
    """Rounds of 40 namespaces mapped and dropped by one uid while another tenant's namespace
    keeps its blocks: the daemon's namespaces and indexes come back to that one each time."""
    daemon = _daemon(start_daemon, workdir, KVD_TENANTS_NAMESPACE_IDLE_TIMEOUT="0s",
                     KVD_TENANTS_MAX_NAMESPACES="16")
    keep = _as(OTHER, daemon.socket, "store", "keep", 1)
    assert keep["stored"] == 8
    for round_ in range(SOAK_ROUNDS):
        out = _as(CHURNER, daemon.socket, "map", f"round-{round_}", 40)
        assert out["opened"] == 40, out          # never more than 16 at once: none refused
        wait_until(lambda: _namespaces(daemon, "churn") == 0 and len(_indexes(daemon)) == 1,
                   15, "the round's namespaces to be forgotten")
        record("churn namespaces", 40)
    back = _as(OTHER, daemon.socket, "store", "keep", 1)
    assert back["hits"] == 8, "the other tenant's blocks did not survive the churn"


# --- the engine process ------------------------------------------------------------------------


LAYOUT = KvLayout(BLOCK, 1, BLOCK, 16, "bfloat16", max_key_bytes=KEY_BYTES)


def _open_map(sock: str, model: str) -> tuple[KvdClient, OffloadSession]:
    """A fast-path engine's session in `model`: it maps the index at its first step, and
    reads all of it (every page then exists in the node's shared memory)."""
    client = KvdClient(sock, model=model, layout=LAYOUT, deadline_s=2.0,
                       engine_id=f"churn-{os.getpid()}", engine_kind="pytest")
    session = OffloadSession(client, reserve=4)
    try:
        if not client.wait_available(10):
            raise SystemExit(f"engine did not connect for {model}")
        assert session.lookup(b"k" * KEY_BYTES) is Lookup.MISS
        session.end_step()
        assert session._index is not None, "the index was not mapped"
        assert not any(session._index.mapping[4096::4096]), "an empty index holds something"
    except BaseException:
        session.close()
        client.close()
        raise
    return client, session


def _map(sock: str, model: str) -> None:
    """`_open_map`, then the session closed as an engine closes it (CloseSession)."""
    client, session = _open_map(sock, model)
    session.close()
    client.close()


def _register(sock: str, model: str) -> Engine:
    e = Engine(sock, model, block=BLOCK, engine_id=f"churn-{os.getpid()}", register=False)
    layout = kvd_pb2.KvLayout(block_bytes=BLOCK, num_ranks=1, shard_bytes=BLOCK,
                              tokens_per_block=16, dtype="bfloat16", max_key_bytes=KEY_BYTES)
    try:
        e.reg = e.call("RegisterSession", kvd_pb2.RegisterSessionRequest(
            engine=kvd_pb2.EngineIdentity(engine_id="churn", engine_kind="pytest",
                                          pid=os.getpid()),
            model=model, layout=layout))
    except BaseException:
        e.close()
        raise
    return e


def _main(argv: list[str]) -> int:
    """`UID SOCKET ACTION PREFIX N hold|exit|wait`: drop to UID, then open N namespaces
    (models PREFIX-0 ...): `map` maps each one's index, reads it and closes, `map-exit` does
    the same but keeps every session open, `register` registers a session in each (kept open
    until the end with `hold` or `wait`), `store` stores 8 blocks in each and reads them back.
    Prints one JSON line: tenant, opened, refused ([code, message] of the first refusal),
    stored, hits. With `wait` it then waits for its stdin to close before it ends its
    sessions; `map-exit` exits without ending any (its streams break as it goes)."""
    uid, sock, action, prefix, n, mode = (int(argv[0]), argv[1], argv[2], argv[3],
                                          int(argv[4]), argv[5])
    hold = mode in ("hold", "wait")
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    out: dict = {"tenant": None, "opened": 0, "refused": None, "stored": 0, "hits": 0}
    engines: list[Engine] = []
    mapped: list[tuple[KvdClient, OffloadSession]] = []
    try:
        for i in range(n):
            model = f"{prefix}-{i}"
            try:
                if action == "map":
                    _map(sock, model)
                    out["opened"] += 1
                    continue
                if action == "map-exit":
                    mapped.append(_open_map(sock, model))
                    out["opened"] += 1
                    continue
                e = _register(sock, model)
            except grpc.RpcError as exc:
                out["refused"] = [exc.code().name, exc.details()]
                break
            out["opened"] += 1
            out["tenant"] = e.info.tenant
            if action == "store":
                keys = keys_for(model, 8)
                out["stored"] += len(e.store(keys).keys_to_store)
                out["hits"] += sum(s == kvd_pb2.BLOCK_STATE_HIT for s in e.lookup(keys).states)
            if hold:
                engines.append(e)
            else:
                e.close()
        if action in ("map", "map-exit"):
            probe = Engine(sock, f"{prefix}-probe", register=False)
            out["tenant"] = probe.info.tenant
            probe.close()
        if mode == "wait":
            print(json.dumps(out), flush=True)
            sys.stdin.read()
        if mapped:
            os._exit(0)             # no CloseSession, no stream closed in order
    finally:
        for e in engines:
            e.close()
    if mode != "wait":
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
