"""Namespace churn against a real daemon, with engines running as another uid.

Every namespace has a shared index sized for the whole pool (36 MiB for a 1 GiB pool of 4 KiB
blocks with 128-byte keys). An engine process that opens namespace after namespace (a new
model, layout or salt each time), maps each index once and exits must not leave them behind:
a namespace with no session and no block is forgotten after `tenants.namespace_idle_timeout`
and its index closed, and a tenant holds at most `tenants.max_namespaces` at once (the next is
refused RESOURCE_EXHAUSTED, naming the setting), whatever the other tenants do.

`KVD_SOAK_CHURN_ROUNDS` sets the soak variant's rounds (`make soak`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from kvd_client.client import KvdClient
from kvd_client.offload.session import Lookup, OffloadSession
from kvd_proto import kvd_pb2
from kvd_proto.wire import KvLayout
from tests.support.daemon import PY, ROOT, clean_env
from tests.support.engine import Engine, keys_for
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


def _namespaces(daemon, tenant: str) -> int:
    return sum(ns["tenant"] == tenant for ns in daemon.stats()["namespaces"])


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
    assert _indexes(daemon) == [INDEX_BYTES + 4096]


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


def _map(sock: str, model: str) -> None:
    """A fast-path engine's session in `model`: it maps the index at its first step."""
    client = KvdClient(sock, model=model, layout=LAYOUT, deadline_s=2.0,
                       engine_id=f"churn-{os.getpid()}", engine_kind="pytest")
    session = OffloadSession(client, reserve=4)
    try:
        if not client.wait_available(10):
            raise SystemExit(f"engine did not connect for {model}")
        assert session.lookup(b"k" * KEY_BYTES) is Lookup.MISS
        session.end_step()
        assert session._index is not None, "the index was not mapped"
    finally:
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
    """`UID SOCKET ACTION PREFIX N hold|exit`: drop to UID, then open N namespaces (models
    PREFIX-0 ...): `map` maps each one's index and closes, `register` registers a session in
    each (kept open until the end with `hold`), `store` stores 8 blocks in each and reads them
    back. Prints one JSON line: tenant, opened, refused ([code, message] of the first refusal),
    stored, hits."""
    uid, sock, action, prefix, n, hold = (int(argv[0]), argv[1], argv[2], argv[3],
                                          int(argv[4]), argv[5] == "hold")
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    out: dict = {"tenant": None, "opened": 0, "refused": None, "stored": 0, "hits": 0}
    engines: list[Engine] = []
    try:
        for i in range(n):
            model = f"{prefix}-{i}"
            try:
                if action == "map":
                    _map(sock, model)
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
        if action == "map":
            probe = Engine(sock, f"{prefix}-probe", register=False)
            out["tenant"] = probe.info.tenant
            probe.close()
    finally:
        for e in engines:
            e.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
