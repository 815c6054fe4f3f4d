"""A real `kvd serve` for tests: started on a temporary socket with short test timeouts,
talked to through the CLI, admin stubs and health, and always stopped (SIGTERM, then SIGKILL
after a bound)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvd_proto import kvd_pb2, kvd_pb2_grpc
from tests.support.waits import wait_until

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
POOL = "64MiB"
EXTENT = "4MiB"
LIVENESS = "1s"
HEARTBEAT = "200ms"
START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a child: this checkout importable, no stray KVD_* settings (but
    KVD_NATIVE: which of the index loops a test run uses, compiled or Python)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_") or k == "KVD_NATIVE"}
    env.pop("NOTIFY_SOCKET", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def target(path: str) -> str:
    return f"unix://{path}"


@dataclass
class Daemon:
    """A `kvd serve` child process and the ways a test talks to it."""

    socket: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str]
    _channels: list[grpc.Channel] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kvd(self, *args: str, timeout: float = 30.0,
            socket: bool = True) -> subprocess.CompletedProcess[str]:
        """Run the `kvd` CLI against this daemon."""
        argv = [PY, "-m", "kvd_server", *args] + (["--socket", self.socket] if socket else [])
        return subprocess.run(argv, env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT)

    def stats(self) -> dict[str, Any]:
        out = self.admin().Stats(kvd_pb2.StatsRequest(), timeout=5)
        return json.loads(out.json)

    def channel(self) -> grpc.Channel:
        ch = grpc.insecure_channel(target(self.socket))
        self._channels.append(ch)
        return ch

    def admin(self) -> kvd_pb2_grpc.KvdAdminStub:
        return kvd_pb2_grpc.KvdAdminStub(self.channel())

    def admin_md(self) -> tuple[tuple[str, str], ...]:
        """Metadata carrying an admin token, asked for on the attach socket (as `kvd reset`)."""
        from kvd_proto.attach import request_admin_token
        from kvd_proto.wire import ADMIN_TOKEN_METADATA

        return ((ADMIN_TOKEN_METADATA, request_admin_token(self.socket, 5.0)),)

    def engine_stub(self) -> kvd_pb2_grpc.KvdEngineStub:
        return kvd_pb2_grpc.KvdEngineStub(self.channel())

    def serving(self) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        if self.proc.poll() is not None:
            raise AssertionError(f"kvd serve exited with {self.proc.returncode}:\n{self.log()}")
        if not os.path.exists(self.socket):
            return False
        with grpc.insecure_channel(target(self.socket)) as ch:
            try:
                out = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=1)
            except grpc.RpcError:
                return False
        return out.status == health_pb2.HealthCheckResponse.SERVING

    def terminate(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM and wait; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        self._channels.clear()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT)


def spawn_daemon(workdir: Path, *args: str, env: dict[str, str] | None = None,
                 socket: str | None = None, wait: bool = True) -> Daemon:
    """Start `kvd serve` on `socket` (default: workdir/kvd.sock) with the test settings."""
    socket = socket or str(workdir / "kvd.sock")
    env = env or clean_env(KVD_MANAGER_HEARTBEAT_INTERVAL=HEARTBEAT,
                           KVD_MANAGER_LIVENESS_TIMEOUT=LIVENESS,
                           KVD_SERVER_DRAIN_TIMEOUT="5s")
    log_path = workdir / f"kvd-{time.monotonic_ns()}.log"
    argv = [PY, "-m", "kvd_server", "serve", "--socket", socket, *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    daemon = Daemon(socket=socket, proc=proc, log_path=log_path, env=env)
    if wait:
        try:
            wait_until(daemon.serving, START_TIMEOUT, "kvd serve to report SERVING")
        except BaseException:
            daemon.close()
            raise
    return daemon


def as_user(uid: int, sock: str, *args: str) -> dict[str, Any]:
    """Run tests/support/as_user.py's ACTION ARGS as `uid` (gid the same) against the daemon
    at `sock`: its one JSON line."""
    out = subprocess.run([PY, "-m", "tests.support.as_user", str(uid), str(uid), sock, *args],
                         env=clean_env(), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])
