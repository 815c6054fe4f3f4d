"""systemd's side of the service protocol, for tests: the notify socket and the unit's
file-descriptor store (FDSTORE=1 / FDNAME= / FDSTOREREMOVE=1), and starting `kvd serve` the way
systemd starts a unit again (the stored descriptors at 3, 4, ... with LISTEN_FDS,
LISTEN_FDNAMES and LISTEN_PID)."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

from tests.support.daemon import HEARTBEAT, LIVENESS, PY, ROOT, Daemon, clean_env
from tests.support.waits import wait_until

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

    def start(self, workdir: Path, socket_path: str, *args: str, **env_extra: str) -> Daemon:
        """`kvd serve ARGS` under this unit, handed the stored descriptors (warm restart on,
        in systemd's store; `env_extra`: more environment)."""
        with self._lock:
            names = [n for n, fds in self.store.items() for _ in fds]
            fds = [fd for n in self.store for fd in self.store[n]]
        env = clean_env(NOTIFY_SOCKET=self.path, KVD_MANAGER_HEARTBEAT_INTERVAL=HEARTBEAT,
                        KVD_MANAGER_LIVENESS_TIMEOUT=LIVENESS, KVD_SERVER_DRAIN_TIMEOUT="5s",
                        KVD_RESTART_WARM="true", KVD_RESTART_STORE="systemd", **env_extra)
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
