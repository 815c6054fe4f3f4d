"""`kvd health --wait` gives up early when no daemon is coming: nothing listens on the socket
and no process holds the socket path's lock (a daemon takes it before anything else, and holds
it until it exits). It used to wait its whole default (5 minutes) after a `kvd serve &` that
failed at once. A daemon that is starting (holding the lock) is still waited for."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.daemon import PY, ROOT, clean_env, spawn_daemon
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc

GIVE_UP_S = 5.0          # kvd_server.cli.main.NO_DAEMON_S
BOUND_S = 30.0           # far below the 5-minute default, with room for a loaded machine


def _health_wait(sock: str, *wait: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    out = subprocess.run([PY, "-m", "kvd_server", "health", "--wait", *wait, "--socket", sock],
                         env=clean_env(), capture_output=True, text=True, timeout=400,
                         cwd=ROOT)
    return out, time.monotonic() - started


def test_wait_gives_up_when_no_daemon_ever_comes(workdir: Path):
    out, elapsed = _health_wait(str(workdir / "kvd.sock"))
    assert out.returncode == 2, out.stderr
    assert "no kvd daemon is serving or starting" in out.stderr, out.stderr
    assert "kvd serve" in out.stderr and out.stdout == ""
    assert GIVE_UP_S <= elapsed < BOUND_S, elapsed


def test_wait_gives_up_after_a_serve_that_failed_at_once(workdir: Path):
    """`kvd serve & kvd health --wait` with a serve that cannot start (its pool does not
    fit): the wait ends soon after, exit 2, instead of after 5 minutes."""
    sock = str(workdir / "kvd.sock")
    serve = subprocess.Popen([PY, "-m", "kvd_server", "serve", "--socket", sock,
                              "--pool-size", "1000TiB"], env=clean_env(), cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        out, elapsed = _health_wait(sock)
        assert serve.wait(timeout=30) == 1
    finally:
        if serve.poll() is None:
            serve.kill()
        serve.communicate()
    assert out.returncode == 2 and "no kvd daemon is serving or starting" in out.stderr, \
        out.stderr
    assert elapsed < BOUND_S, elapsed


def test_wait_gives_up_after_the_daemon_was_killed(workdir: Path):
    """A killed daemon leaves a stale socket; its lock went with it."""
    daemon = spawn_daemon(workdir, "--pool-size", "4MiB", "--extent-size", "1MiB")
    try:
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(timeout=15)
        assert os.path.exists(daemon.socket)               # stale: nothing listens
        out, elapsed = _health_wait(daemon.socket)
    finally:
        daemon.close()
    assert out.returncode == 2 and "no kvd daemon is serving or starting" in out.stderr, \
        out.stderr
    assert elapsed < BOUND_S, elapsed


def test_wait_goes_on_while_the_lock_is_held(workdir: Path):
    """A daemon between taking its lock and listening (here: a process holding the lock the
    way a starting daemon does) is waited for past the give-up delay, to --wait's end."""
    sock = workdir / "kvd.sock"
    holder = subprocess.Popen(
        [PY, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | "
                   "os.O_CREAT, 0o644); fcntl.flock(fd, fcntl.LOCK_EX); print('held', "
                   "flush=True); time.sleep(60)", f"{sock}.lock"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        out, elapsed = _health_wait(str(sock), "8s")
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 2 and "no kvd daemon socket at" in out.stderr, out.stderr
    assert elapsed >= 8.0, elapsed


def test_a_second_daemon_is_refused_while_the_first_holds_the_lock(workdir: Path):
    """The lock also keeps two daemons apart while the first one is still starting."""
    sock = workdir / "kvd.sock"
    fd = os.open(f"{sock}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, b"4242\n", 0)
        out = subprocess.run([PY, "-m", "kvd_server", "serve", "--socket", str(sock),
                              "--pool-size", "4MiB"], env=clean_env(), capture_output=True,
                             text=True, timeout=60, cwd=ROOT)
    finally:
        os.close(fd)
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "another kvd daemon is serving" in last and "pid 4242" in last, out.stderr
    assert not sock.exists()


def test_the_daemon_holds_the_lock_while_it_serves_and_removes_it_at_exit(workdir: Path):
    daemon = spawn_daemon(workdir, "--pool-size", "4MiB", "--extent-size", "1MiB")
    lock = Path(daemon.socket + ".lock")
    try:
        assert lock.read_text().strip() == str(daemon.proc.pid)
        fd = os.open(lock, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        # A waiting `kvd health` tests the lock over and over: the daemon does not mind.
        out, _ = _health_wait(daemon.socket, "5s")
        assert (out.returncode, out.stdout) == (0, "SERVING\n"), out.stderr
        assert daemon.terminate() == 0
        wait_until(lambda: not lock.exists(), 5, "the lock file to go")
    finally:
        daemon.close()
