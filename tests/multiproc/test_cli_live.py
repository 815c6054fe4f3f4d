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
