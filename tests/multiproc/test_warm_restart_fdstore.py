"""Warm restart through systemd's file-descriptor store (restart.store = "systemd"), with this
test playing systemd's side of the protocol: it owns NOTIFY_SOCKET, keeps the descriptors the
daemon stores (FDSTORE=1, FDNAME=) and forgets the ones it removes (FDSTOREREMOVE=1), and
starts the next daemon the way systemd does after `systemctl restart` or a crash: the stored
descriptors at 3, 4, ... with LISTEN_FDS, LISTEN_FDNAMES and LISTEN_PID.

The pool stays a sealed memfd, so engines of any allowed uid keep being served; blocks stored
before the SIGKILL are adopted and load byte for byte after it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvd_proto import kvd_pb2
from tests.support.daemon import HEARTBEAT, LIVENESS, PY, ROOT, Daemon, clean_env
from tests.support.engine import Engine, block_bytes_of, keys_for
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc
MODEL = "fdstore-model"

# Starts the daemon as systemd would: the stored descriptors moved to 3, 4, ... and the
# LISTEN_* variables naming them, with LISTEN_PID this very process (it execs the daemon).
LAUNCHER = """
import fcntl, os, sys
names = sys.argv[1].split(":") if sys.argv[1] else []
fds = [int(f) for f in sys.argv[2].split(",") if f]
# Out of the way first (a stored descriptor may sit at 3, 4, ... already), then into place.
high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in fds]
for fd in fds:
    os.close(fd)
for i, fd in enumerate(high):
    os.dup2(fd, 3 + i, inheritable=True)
    os.close(fd)
if fds:
    os.environ.update(LISTEN_FDS=str(len(fds)), LISTEN_FDNAMES=":".join(names),
                      LISTEN_PID=str(os.getpid()))
os.execv(sys.executable, [sys.executable, *sys.argv[3:]])
"""


class FakeSystemd:
    """The notify socket and the descriptor store of one unit."""

    def __init__(self, directory: Path) -> None:
        self.path = str(directory / "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.store: dict[str, list[int]] = {}       # name -> descriptors (ours)
        self.messages: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 65536, 64)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines()
                          if "=" in line)
            with self._lock:
                self.messages.append(data.decode())
                name = fields.get("FDNAME", "stored")
                if fields.get("FDSTORE") == "1":
                    self.store.setdefault(name, []).extend(fds)
                    continue
                if fields.get("FDSTOREREMOVE") == "1":
                    for fd in self.store.pop(name, []):
                        os.close(fd)
                for fd in fds:
                    os.close(fd)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self.store)

    def start(self, workdir: Path, socket_path: str, *args: str) -> Daemon:
        """`kvd serve ARGS` under this unit, handed the stored descriptors."""
        with self._lock:
            names = [n for n, fds in self.store.items() for _ in fds]
            fds = [fd for n in self.store for fd in self.store[n]]
        env = clean_env(NOTIFY_SOCKET=self.path, KVD_MANAGER_HEARTBEAT_INTERVAL=HEARTBEAT,
                        KVD_MANAGER_LIVENESS_TIMEOUT=LIVENESS, KVD_SERVER_DRAIN_TIMEOUT="5s",
                        KVD_RESTART_WARM="true", KVD_RESTART_STORE="systemd")
        log_path = workdir / f"kvd-{time.monotonic_ns()}.log"
        argv = [PY, "-c", LAUNCHER, ":".join(names), ",".join(map(str, fds)), "-m",
                "kvd_server", "serve", "--socket", socket_path, *args]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=ROOT, pass_fds=fds)
        daemon = Daemon(socket=socket_path, proc=proc, log_path=log_path, env=env)
        try:
            wait_until(daemon.serving, 60, "kvd serve to report SERVING")
        except BaseException:
            daemon.close()
            raise
        return daemon

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        for fds in self.store.values():
            for fd in fds:
                os.close(fd)
        self.store.clear()


@pytest.fixture
def systemd(workdir: Path):
    unit = FakeSystemd(workdir)
    yield unit
    unit.close()


POOL = ("--pool-size", "8MiB", "--extent-size", "1MiB")


def test_blocks_survive_a_sigkill_through_the_descriptor_store(systemd, workdir):
    sock = str(workdir / "kvd.sock")
    daemon = systemd.start(workdir, sock, *POOL)
    try:
        wait_until(lambda: "READY=1" in "".join(systemd.messages), 10, "READY=1")
        names = systemd.names()
        assert "kvd-pool" in names and any(n.startswith("kvd-state-") for n in names), names
        engine = Engine(sock, MODEL)
        keys = keys_for("fdstore", 24)
        assert len(engine.store(keys).keys_to_store) == 24
        pool_id = engine.info.pool_id
        ns = engine.reg.namespace_id
        engine.call("CloseSession", kvd_pb2.CloseSessionRequest())
        engine.close()
        assert f"kvd-index-{ns}" in systemd.names()
        assert len([n for n in systemd.names() if n.startswith("kvd-state-")]) == 1, \
            "an older record was not removed from the store"
    finally:
        daemon.proc.kill()
        daemon.proc.wait(20)
    assert not any(Path("/dev/shm").glob("*kvd*fdstore*"))        # nothing named anywhere
    daemon = systemd.start(workdir, sock, *POOL)
    try:
        restart = daemon.stats()["restart"]
        assert restart["adopted"] and restart["blocks_adopted"] == 24, restart
        assert restart["directory"] == "systemd's file-descriptor store"
        assert daemon.stats()["pool"]["backing"] == "memfd"
        engine = Engine(sock, MODEL)
        try:
            assert engine.info.pool_id == pool_id, "the same pool was not adopted"
            states = engine.lookup(keys).states
            assert list(states) == [kvd_pb2.BLOCK_STATE_HIT] * 24
            data = engine.load(keys)
            assert all(d == block_bytes_of(k) for k, d in zip(keys, data, strict=True))
        finally:
            engine.call("CloseSession", kvd_pb2.CloseSessionRequest())
            engine.close()
        # A clean stop keeps the store too (systemctl restart = stop + start).
        assert daemon.terminate() == 0
        daemon = systemd.start(workdir, sock, *POOL, "--cold")
        restart = daemon.stats()["restart"]
        assert restart["cold_reason"] == "kvd serve --cold" and not restart["blocks_adopted"]
        assert f"kvd-index-{ns}" not in systemd.names()
    finally:
        daemon.close()


def test_store_systemd_outside_systemd_is_refused_at_start(workdir):
    env = clean_env(KVD_RESTART_WARM="true", KVD_RESTART_STORE="systemd")
    env.pop("NOTIFY_SOCKET", None)
    proc = subprocess.run([PY, "-m", "kvd_server", "serve", "--socket",
                           str(workdir / "kvd.sock"), *POOL], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "NOTIFY_SOCKET is not set" in last and "FileDescriptorStoreMax" in last, last


def test_the_launcher_hands_descriptors_at_three(tmp_path):
    r, w = os.pipe()
    os.write(w, b"x")
    out = subprocess.run([sys.executable, "-c", LAUNCHER, "a", str(r), "-c",
                          "import os; print(os.environ['LISTEN_FDS'], os.read(3, 1))"],
                         pass_fds=[r], capture_output=True, text=True, timeout=30)
    os.close(r)
    os.close(w)
    assert out.stdout.split() == ["1", "b'x'"], out.stderr
