"""`kvd serve` as an operator sees it: start with no configuration, health, stats, config,
refusing a second daemon, stale sockets, SIGTERM and `kvd drain`."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess

import pytest

from tests.support.daemon import PY, ROOT, Daemon, clean_env, spawn_daemon
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc


def test_serve_with_no_configuration_starts_and_sigterm_cleans_up(workdir):
    runtime = workdir / "run"
    runtime.mkdir(mode=0o700)
    env = clean_env(XDG_RUNTIME_DIR=str(runtime))
    log_path = workdir / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([PY, "-m", "kvd_server", "serve"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT)
    sock = runtime / "kvd" / "kvd.sock"
    daemon = Daemon(socket=str(sock), proc=proc, log_path=log_path, env=env)
    try:
        wait_until(daemon.serving, 60, "the default daemon to serve")
        assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o750
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
        assert os.path.exists(str(sock) + ".attach")
        # The CLI finds the daemon by the same default rule, without --socket.
        health = daemon.kvd("health", socket=False)
        assert (health.returncode, health.stdout.strip()) == (0, "SERVING"), health.stderr
        log = daemon.log()
        for fact in ("0.1.0", "1GiB", "memfd", str(sock), "lru"):
            assert fact in log, fact
        assert daemon.terminate() == 0
        assert not sock.exists() and not os.path.exists(str(sock) + ".attach")
    finally:
        daemon.close()


def test_health_stats_and_config(daemon: Daemon):
    health = daemon.kvd("health")
    assert health.returncode == 0 and health.stdout.strip() == "SERVING"

    out = daemon.kvd("stats", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["pool"]["total_bytes"] == 64 << 20
    assert doc["pool"]["free_bytes"] == 64 << 20
    assert set(doc["blocks"]) >= {"storing", "ready", "pinned", "zombie", "total"}
    assert doc["sessions"] == 0
    assert doc["server"]["state"] == "serving"

    text = daemon.kvd("stats")
    assert text.returncode == 0
    assert "# pool" in text.stdout and "64MiB" in text.stdout
    assert all(len(line) <= 80 for line in text.stdout.splitlines())

    cfg = daemon.kvd("config", "--json")
    assert cfg.returncode == 0
    effective = json.loads(cfg.stdout)
    assert effective["server"]["socket"] == daemon.socket
    assert effective["pool"]["size"] == 64 << 20
    assert effective["manager"]["liveness_timeout"] == 1.0

    sessions = daemon.kvd("sessions")
    assert sessions.returncode == 0 and "0 session(s)" in sessions.stdout


def test_second_daemon_on_a_live_socket_is_refused(daemon: Daemon, workdir):
    second = subprocess.run([PY, "-m", "kvd_server", "serve", "--socket", daemon.socket,
                             "--pool-size", "4MiB"], env=clean_env(), capture_output=True,
                            text=True, timeout=30, cwd=ROOT)
    assert second.returncode == 1
    assert "another kvd daemon is serving" in second.stderr
    assert "Traceback" not in second.stderr
    assert daemon.kvd("health").returncode == 0  # the first one is untouched


def test_stale_socket_is_replaced(start_daemon, workdir):
    path = str(workdir / "kvd.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(path)  # a socket file nobody listens on, like after a crash
    daemon = start_daemon("--pool-size", "4MiB", "--extent-size", "1MiB")
    assert daemon.kvd("health").returncode == 0
    assert "removing stale socket" in daemon.log()


def test_drain_exits_zero_and_removes_sockets(daemon: Daemon):
    out = daemon.kvd("drain")
    assert out.returncode == 0, out.stderr
    assert daemon.proc.wait(timeout=15) == 0
    assert not os.path.exists(daemon.socket)
    assert not os.path.exists(daemon.socket + ".attach")
    gone = daemon.kvd("health")
    assert gone.returncode == 2 and "no kvd daemon socket" in gone.stderr


def test_bad_configuration_exits_1_with_the_key(workdir):
    out = subprocess.run([PY, "-m", "kvd_server", "serve", "--socket", str(workdir / "k.sock")],
                         env=clean_env(KVD_POOL_SIZE="twelve"), capture_output=True, text=True,
                         timeout=30, cwd=ROOT)
    assert out.returncode == 1
    assert "pool.size" in out.stderr and "KVD_POOL_SIZE" in out.stderr
    assert not os.path.exists(workdir / "k.sock")


def test_sigterm_exits_zero(workdir):
    daemon = spawn_daemon(workdir, "--pool-size", "4MiB", "--extent-size", "1MiB")
    try:
        assert daemon.terminate() == 0
        assert not os.path.exists(daemon.socket)
        assert "drained" in daemon.log() or "draining" in daemon.log()
    finally:
        daemon.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_endpoint_and_systemd_readiness(start_daemon, workdir):
    import urllib.request

    notify_path = str(workdir / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(notify_path)
        notify.settimeout(30)
        port = _free_port()
        env = clean_env(NOTIFY_SOCKET=notify_path)
        daemon = start_daemon("--pool-size", "4MiB", "--extent-size", "1MiB",
                              "--metrics-port", str(port), env=env)
        messages = []
        while not any("READY=1" in m for m in messages):
            messages.append(notify.recv(4096).decode())
        assert daemon.kvd("stats").returncode == 0  # an admin call to show up in the metrics
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert "kvd_pool_total_bytes 4.194304e+06" in text
        assert 'kvd_state{state="serving"} 1.0' in text
        assert 'kvd_rpc_duration_seconds_count{method="Stats"}' in text
        assert daemon.terminate() == 0
        notify.settimeout(5)
        messages.append(notify.recv(4096).decode())
        assert any("STOPPING=1" in m for m in messages)


def test_a_stopped_daemon_does_not_reap_sessions_for_its_own_silence(daemon: Daemon):
    """SIGSTOP the daemon for 2.5x the liveness timeout: its engines' heartbeats wait in the
    socket buffers, so after SIGCONT their sessions, pins and stores are all still there."""
    import signal
    import time

    from kvd_proto import kvd_pb2
    from tests.support.engine import Engine, keys_for

    e = Engine(daemon.socket)
    try:
        e.store(keys_for("stall", 2))
        grant = e.store(keys_for("stall-pending", 1), complete=False)
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(2.5)                    # LIVENESS is 1 s
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        time.sleep(0.5)                        # several sweeps after the stall
        (row,) = daemon.admin().ListSessions(kvd_pb2.ListSessionsRequest(), timeout=5).sessions
        assert row.pending_stores == 1
        done = e.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
            keys=grant.keys_to_store, success=True, epoch=grant.epoch,
            slot_offsets=grant.slot_offsets))
        assert done.completed == 1
        assert "did not run for" in daemon.log()
    finally:
        e.close()


def test_cli_against_a_stopped_daemon_exits_2_within_its_timeout(daemon: Daemon):
    import signal
    import time

    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        for command in (("stats",), ("reset", "--yes"), ("drain",)):
            t0 = time.monotonic()
            out = daemon.kvd(*command, "--timeout", "1")
            assert out.returncode == 2, (command, out.stderr)
            assert "did not answer" in out.stderr and "Traceback" not in out.stderr
            assert time.monotonic() - t0 < 10
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert daemon.kvd("health").returncode == 0
