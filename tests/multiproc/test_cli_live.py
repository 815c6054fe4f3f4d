"""The `kvd` command against real daemons: waiting for health, finding the system daemon's
socket, sessions as JSON and in full, and one-line refusals at start."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from kvd_proto import kvd_pb2, paths
from kvd_server.cli import main as cli
from tests.support.daemon import PY, ROOT, Daemon, clean_env, spawn_daemon
from tests.support.engine import keys_for
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc


def _kvd(*args: str, env: dict[str, str] | None = None,
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "kvd_server", *args], env=env or clean_env(),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_health_wait_covers_start_and_prefault(workdir):
    """`kvd serve & kvd health --wait`: the wait starts before the daemon has a socket and
    ends, exit 0, once the pool is pre-faulted and the daemon serves."""
    sock = str(workdir / "kvd.sock")
    waiter = subprocess.Popen([PY, "-m", "kvd_server", "health", "--wait", "60", "--socket",
                               sock], env=clean_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT)
    time.sleep(1.0)
    assert waiter.poll() is None, waiter.communicate()   # still waiting: nothing there yet
    daemon = spawn_daemon(workdir, "--pool-size", "256MiB", socket=sock, wait=False)
    try:
        out, err = waiter.communicate(timeout=90)
        assert (waiter.returncode, out, err) == (0, "SERVING\n", "")
        assert "pool pre-faulted" in daemon.log()
    finally:
        daemon.close()


def test_health_wait_gives_up_after_its_timeout(workdir):
    started = time.monotonic()
    out = _kvd("health", "--wait", "1.5s", "--socket", str(workdir / "none.sock"))
    elapsed = time.monotonic() - started
    assert out.returncode == 2 and "no kvd daemon socket at" in out.stderr, out.stderr
    assert 1.5 <= elapsed < 15, elapsed


def test_health_wait_reports_a_daemon_that_stays_not_serving(daemon: Daemon, engines):
    """A draining daemon holding a load in flight answers NOT_SERVING until the wait ends."""
    engine = engines()
    keys = keys_for("wait", 2)
    engine.store(keys)
    engine.call("PrepareLoad", kvd_pb2.PrepareLoadRequest(keys=keys, req_id="w"))
    assert daemon.kvd("drain", "--drain-timeout", "30s").returncode == 0
    out = daemon.kvd("health", "--wait", "1")
    assert (out.returncode, out.stdout) == (1, "NOT_SERVING\n"), out.stderr


def test_health_wait_does_not_wait_for_a_path_that_cannot_be_a_socket(workdir):
    (workdir / "dir").write_text("a file where a directory should be")
    started = time.monotonic()
    out = _kvd("health", "--wait", "30", "--socket", str(workdir / "dir" / "kvd.sock"))
    assert out.returncode == 2 and "cannot connect" in out.stderr, out.stderr
    assert time.monotonic() - started < 15


def test_clients_find_the_system_daemon_without_socket(start_daemon, workdir, monkeypatch,
                                                       capsys):
    """On a systemd/Kubernetes node the user's own default socket does not exist: the CLI and
    kvd_client try the system daemon's socket (here a stand-in for /run/kvd/kvd.sock)."""
    from kvd_client.client import KvdClient
    from kvd_proto.wire import KvLayout

    system = workdir / "run-kvd" / "kvd.sock"
    system.parent.mkdir()
    daemon = start_daemon("--pool-size", "16MiB", "--extent-size", "4MiB", socket=str(system))
    monkeypatch.setattr(paths, "SYSTEM_SOCKET", str(system))
    for name in ("KVD_SOCKET", "KVD_SERVER_SOCKET", "KVD_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(workdir / "user-runtime"))
    assert cli.main(["stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["server"]["socket"] == daemon.socket
    client = KvdClient(model="m", layout=KvLayout(block_bytes=4096, num_ranks=1,
                                                  shard_bytes=4096))
    try:
        assert client.socket_path == daemon.socket and client.wait_available(10)
    finally:
        client.close()


def test_sessions_json_numbers_and_wide_model(daemon: Daemon, engines):
    model = "an-org/a-model-name-longer-than-the-column@" + "0123456789abcdef" * 2
    engines(model=model)
    doc = json.loads(daemon.kvd("sessions", "--json").stdout)
    (row,) = doc["sessions"]
    assert row["pins"] == 0 and row["pending_stores"] == 0 and isinstance(row["leases"], int)
    narrow = daemon.kvd("sessions").stdout
    assert model not in narrow and all(len(line) <= 80 for line in narrow.splitlines())
    assert model in daemon.kvd("sessions", "--wide").stdout


def test_stats_counts_a_lease_once_in_each_vocabulary(daemon: Daemon, engines):
    engine = engines()
    keys = keys_for("lease", 2)
    engine.store(keys)
    engine.lookup(keys, lease_ms=10_000)
    text = daemon.kvd("stats").stdout
    assert "pinned (load or lease)  2" in text
    assert "load pins               0" in text and "lookup leases           2" in text


def test_serve_under_a_regular_file_says_so(workdir):
    (workdir / "plain").write_text("")
    out = _kvd("serve", "--socket", str(workdir / "plain" / "sub" / "kvd.sock"))
    assert out.returncode == 1
    assert f"{workdir / 'plain'} is a file, not a directory" in out.stderr, out.stderr
    assert "File exists" not in out.stderr and "Traceback" not in out.stderr


def test_relative_socket_is_taken_from_the_current_directory(workdir):
    """`--socket rel.sock` (like `server.socket = "rel.sock"` or KVD_SERVER_SOCKET) means
    ./rel.sock for the daemon and for the CLI alike."""
    log_path = workdir / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([PY, "-m", "kvd_server", "serve", "--socket", "rel.sock",
                                 "--pool-size", "4MiB"], env=clean_env(), cwd=workdir,
                                stdout=log, stderr=subprocess.STDOUT)
    daemon = Daemon(socket=str(workdir / "rel.sock"), proc=proc, log_path=log_path,
                    env=clean_env())
    try:
        out = subprocess.run([PY, "-m", "kvd_server", "health", "--wait", "30", "--socket",
                              "rel.sock"], env=clean_env(), cwd=workdir, capture_output=True,
                             text=True, timeout=60)
        assert (out.returncode, out.stdout) == (0, "SERVING\n"), out.stderr + daemon.log()
        assert f"serving on {workdir / 'rel.sock'}" in daemon.log()
    finally:
        daemon.close()


def _squeezed(text: str) -> str:
    """Text without its whitespace: a value `kvd stats` wrapped over lines reads as one."""
    return "".join(text.split())


def test_health_and_stats_name_a_degraded_tier_and_why(start_daemon, tmp_path):
    """`kvd health` names the degraded tier and its reason itself (not only "see kvd stats"),
    and `kvd stats` shows that reason whole, wrapped within 80 columns."""
    import socket

    with socket.socket() as s:            # a port nothing listens on: the master is away
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = start_daemon("--pool-size", "16MiB", "--extent-size", "4MiB", env=clean_env(
        KVD_TIERS_CLUSTER_MASTER=f"127.0.0.1:{port}",
        KVD_TIERS_CLUSTER_METADATA_URL=f"http://127.0.0.1:{port}/metadata",
        KVD_TIERS_CLUSTER_SEGMENT_SIZE="0", KVD_TIERS_CLUSTER_RETRY_INTERVAL="1s"))

    def degraded() -> str | None:
        (tier,) = daemon.stats()["tiers"]
        return tier["reason"] if tier["health"] == "degraded" else None

    reason = wait_until(degraded, 30, "the cluster tier to degrade")
    assert len(reason) > 56, reason          # more than a row's value column holds
    health = daemon.kvd("health")
    assert health.returncode == 0, health.stderr
    assert health.stdout.splitlines() == [
        "SERVING", f"tier cluster: NOT_SERVING (degraded: {reason}; the pool serves without "
                   "it)"], health.stdout
    text = daemon.kvd("stats").stdout
    assert _squeezed(f"degraded: {reason}") in _squeezed(text), text
    assert all(len(line) <= 80 for line in text.splitlines()) and "..." not in text, text


def test_stats_says_kvd_native_0_forced_the_python_loops(start_daemon):
    """With the compiled loops built, `KVD_NATIVE=0` in the daemon's environment is why they
    are not used: `kvd stats` and the start-up WARNING say so, not "no C compiler"."""
    from importlib.util import find_spec

    if find_spec("kvd_proto._native") is None:
        pytest.skip("kvd_proto._native was not built here (no C compiler at install)")
    daemon = start_daemon("--pool-size", "16MiB", "--extent-size", "4MiB",
                          env=clean_env(KVD_NATIVE="0"))
    text = daemon.kvd("stats").stdout
    (loops,) = [i for i, line in enumerate(text.splitlines()) if line.startswith("index loops")]
    said = " ".join(line.strip() for line in text.splitlines()[loops:loops + 3])
    assert "forced by KVD_NATIVE=0" in said and "compiler" not in said, said
    assert daemon.stats()["channels"]["native_forced"] is True
    assert "KVD_NATIVE=0 in the daemon's environment forces them" in daemon.log()
    assert "no C compiler" not in daemon.log()


def test_reset_counts_the_blocks_the_disk_tier_drops(start_daemon, tmp_path):
    """`kvd reset` with a disk tier drops what the disk holds of the namespaces too, and says
    how many (its answer carries them: AdminResetResponse.dropped_below_blocks)."""
    from tests.support.disk_tier import POOL, disk_env
    from tests.support.engine import Engine

    daemon = start_daemon("--pool-size", POOL, "--extent-size", "4MiB",
                          env=disk_env(tmp_path / "disk"))

    def tier_of(daemon: Daemon) -> dict:
        (tier,) = daemon.stats()["tiers"]
        return tier

    wait_until(lambda: tier_of(daemon)["health"] == "ok", 20, "the disk tier to open")
    engine = Engine(daemon.socket)
    try:
        keys = keys_for("reset-below", 400)
        for i in range(0, len(keys), 32):
            engine.store(keys[i:i + 32])
        in_pool = daemon.stats()["blocks"]["ready"]
        below = len(keys) - in_pool
        wait_until(lambda: tier_of(daemon)["blocks"] >= below
                   and tier_of(daemon)["queue_depth"] == 0, 20, "the evictions on the disk",
                   detail=lambda: tier_of(daemon))
        out = daemon.kvd("reset", "--yes")
        assert out.returncode == 0, out.stderr
        assert out.stdout == (f"dropped {in_pool} block(s) in 1 namespace(s), and {below} "
                              "held below the pool (disk or cluster tier)\n"), out.stdout
        assert tier_of(daemon)["blocks"] == 0
        answer = daemon.admin().Reset(kvd_pb2.AdminResetRequest(), metadata=daemon.admin_md(),
                                      timeout=5)
        assert (answer.dropped_blocks, answer.dropped_below_blocks) == (0, 0)
    finally:
        engine.close()
