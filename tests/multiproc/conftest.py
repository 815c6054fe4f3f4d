"""Fixtures that run a real `kvd serve` on a temporary socket, and engine clients that talk to
it the way an engine does: attach (fd + token), map the pool, raw KvdEngine stubs.

Every daemon started here is stopped at teardown (SIGTERM, then SIGKILL after a bound), and
its temporary directory removed. Run as a module (`python -m tests.multiproc.conftest ACTION
...`), this file is also the client program the tests start as separate processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvd_proto import kvd_pb2, kvd_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
POOL = "64MiB"
EXTENT = "4MiB"
BLOCK = 64 * 1024
LIVENESS = "1s"
HEARTBEAT = "200ms"
START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
TOKEN = "kvd-session-token"


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.05) -> Any:
    """Poll `predicate` until truthy; fail the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


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


def block_bytes_of(key: bytes, size: int = BLOCK) -> bytes:
    """The deterministic content a test writes for `key`."""
    digest = hashlib.sha256(key).digest()
    return (digest * (size // len(digest) + 1))[:size]


def keys_for(seed: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest()[:16] + i.to_bytes(4, "big")
            for i in range(n)]


# --- the daemon ----------------------------------------------------------------------------


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



# --- engine clients ------------------------------------------------------------------------


def attach(socket: str, engine_id: str = "test") -> Any:
    """Attach as an engine through kvd_client: the pool fd, the token and the pool's facts."""
    from kvd_client.attach import attach as client_attach

    return client_attach(socket, engine_id=engine_id, timeout=5.0)


def map_pool(fd: int, size: int) -> Any:
    """Map the pool shared, as the engine's data plane does (the mapping owns the fd)."""
    from kvd_client.pool_map import PoolMapping

    return PoolMapping(fd, size)


class Engine:
    """One engine session driven with raw KvdEngine stubs (no KvdClient conveniences)."""

    def __init__(self, socket: str, model: str = "test-model", block: int = BLOCK,
                 engine_id: str = "test", register: bool = True,
                 heartbeat: bool = True) -> None:
        self.info = attach(socket, engine_id)
        self.token, self.pool_bytes = self.info.token, self.info.pool_bytes
        self.pool = map_pool(self.info.fd, self.pool_bytes)
        self.channel = grpc.insecure_channel(target(socket))
        self.stub = kvd_pb2_grpc.KvdEngineStub(self.channel)
        self.md = ((TOKEN, self.token),)
        self.block = block
        self.reg: kvd_pb2.RegisterSessionResponse | None = None
        self.notices: list[kvd_pb2.SessionNotice] = []
        self._stop = threading.Event()
        self._stream: threading.Thread | None = None
        if register:
            self.register(model)
        if heartbeat:
            self._stream = threading.Thread(target=self._heartbeat, daemon=True)
            self._stream.start()

    def _heartbeat(self) -> None:
        """Keep the session alive the way a client does: a heartbeat stream every 200 ms."""

        def beats() -> Iterator[kvd_pb2.SessionHeartbeat]:
            seq = 0
            while not self._stop.is_set():
                seq += 1
                yield kvd_pb2.SessionHeartbeat(seq=seq)
                self._stop.wait(0.2)

        with contextlib.suppress(grpc.RpcError, ValueError):
            for notice in self.stub.SessionStream(beats(), metadata=self.md):
                self.notices.append(notice)

    def call(self, method: str, request: Any, timeout: float = 5.0) -> Any:
        return getattr(self.stub, method)(request, metadata=self.md, timeout=timeout)

    def register(self, model: str) -> kvd_pb2.RegisterSessionResponse:
        layout = kvd_pb2.KvLayout(block_bytes=self.block, num_ranks=1, shard_bytes=self.block,
                                  tokens_per_block=16, dtype="bfloat16")
        self.reg = self.call("RegisterSession", kvd_pb2.RegisterSessionRequest(
            engine=kvd_pb2.EngineIdentity(engine_id="test", engine_kind="pytest", pid=os.getpid()),
            model=model, layout=layout))
        return self.reg

    def lookup(self, keys: Sequence[bytes], lease_ms: int = 0) -> kvd_pb2.LookupResponse:
        return self.call("Lookup", kvd_pb2.LookupRequest(keys=keys, lease_ms=lease_ms))

    def store(self, keys: Sequence[bytes], complete: bool = True) -> kvd_pb2.PrepareStoreResponse:
        """Reserve, write each key's bytes into its slot, and (optionally) complete."""
        grant = self.call("PrepareStore", kvd_pb2.PrepareStoreRequest(keys=keys, req_id="r"))
        for key, offset in zip(grant.keys_to_store, grant.slot_offsets, strict=True):
            self.write(offset, block_bytes_of(key, self.block))
        if complete and grant.keys_to_store:
            self.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
                keys=grant.keys_to_store, success=True, req_id="r", epoch=grant.epoch,
                slot_offsets=grant.slot_offsets))
        return grant

    def load(self, keys: Sequence[bytes]) -> list[bytes]:
        """Pin, read each key's slot, unpin."""
        out = self.call("PrepareLoad", kvd_pb2.PrepareLoadRequest(keys=keys, req_id="r"))
        data = [self.read(offset) for offset in out.slot_offsets]
        self.call("CompleteLoad", kvd_pb2.CompleteLoadRequest(keys=keys, req_id="r",
                                                              epoch=out.epoch))
        return data

    def write(self, offset: int, data: bytes) -> None:
        view = self.pool.view(offset, len(data))
        view[:] = data
        view.release()

    def read(self, offset: int) -> bytes:
        view = self.pool.view(offset, self.block)
        data = bytes(view)
        view.release()
        return data

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(grpc.RpcError):
            self.call("CloseSession", kvd_pb2.CloseSessionRequest(), timeout=2)
        if self._stream is not None:
            self._stream.join(timeout=5)
        self.channel.close()
        self.pool.close()


def run_client(socket: str, action: str, *args: str,
               timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run this file as a client process to completion; its stdout is one JSON line."""
    return subprocess.run([PY, "-m", "tests.multiproc.conftest", action, socket, *args],
                          env=clean_env(), capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def start_client(socket: str, action: str, *args: str) -> subprocess.Popen[str]:
    """Start a client process that announces itself with one JSON line and stays alive."""
    return subprocess.Popen([PY, "-m", "tests.multiproc.conftest", action, socket, *args],
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)


def _client_main(argv: Sequence[str]) -> int:
    """Client program: `store|load|hang SOCKET MODEL SEED N`."""
    action, socket, model, seed, n = argv[0], argv[1], argv[2], argv[3], int(argv[4])
    keys = keys_for(seed, n)
    # The "hang" client sends no heartbeats: its session must end by the liveness timeout.
    engine = Engine(socket, model, engine_id=f"client-{action}-{os.getpid()}",
                    heartbeat=action != "hang")
    if action == "store":
        grant = engine.store(keys)
        print(json.dumps({"stored": len(grant.keys_to_store),
                          "offsets": list(grant.slot_offsets),
                          "cannot_store": grant.cannot_store}), flush=True)
    elif action == "load":
        states = list(engine.lookup(keys).states)
        ok = all(s == kvd_pb2.BLOCK_STATE_HIT for s in states)
        data = engine.load(keys) if ok else []
        match = ok and all(d == block_bytes_of(k) for k, d in zip(keys, data, strict=True))
        print(json.dumps({"states": states, "match": match}), flush=True)
    elif action == "hang":
        # Half the keys are ready blocks (stored earlier by someone else): pin them; reserve the
        # other half for a store, write half a block into each slot, then wait to be killed.
        ready, new = keys[: n // 2], keys[n // 2:]
        pinned = engine.call("PrepareLoad", kvd_pb2.PrepareLoadRequest(keys=ready, req_id="h"))
        grant = engine.store(new, complete=False)
        for offset in grant.slot_offsets:
            engine.write(offset, b"\xee" * (engine.block // 2))
        print(json.dumps({"pinned": len(pinned.slot_offsets),
                          "storing": len(grant.keys_to_store)}), flush=True)
        time.sleep(120)  # bounded: the test kills it long before
    else:
        raise SystemExit(f"unknown action {action}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(_client_main(sys.argv[1:]))
else:
    import pytest

    @pytest.fixture
    def workdir() -> Iterator[Path]:
        """A short temporary directory (Unix socket paths are limited to ~100 bytes)."""
        path = Path(tempfile.mkdtemp(prefix="kvd-t-", dir="/tmp"))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    @pytest.fixture
    def start_daemon(workdir: Path) -> Iterator[Callable[..., Daemon]]:
        """Factory: start a daemon (kwargs as spawn_daemon); all of them stop at teardown."""
        started: list[Daemon] = []

        def start(*args: str, **kwargs: Any) -> Daemon:
            daemon = spawn_daemon(workdir, *args, **kwargs)
            started.append(daemon)
            return daemon

        try:
            yield start
        finally:
            for daemon in started:
                daemon.close()
        # A traceback in a daemon's log is a bug even when every assertion passed.
        for daemon in started:
            assert "Traceback" not in daemon.log(), daemon.log()

    @pytest.fixture
    def daemon(start_daemon: Callable[..., Daemon]) -> Daemon:
        """A serving daemon with a 64MiB pool, 4MiB extents and a 1s liveness timeout."""
        return start_daemon("--pool-size", POOL, "--extent-size", EXTENT)

    @pytest.fixture
    def engines(daemon: Daemon) -> Iterator[Callable[..., Engine]]:
        """Factory of Engine sessions on `daemon`, closed at teardown."""
        made: list[Engine] = []

        def make(**kwargs: Any) -> Engine:
            engine = Engine(daemon.socket, **kwargs)
            made.append(engine)
            return engine

        try:
            yield make
        finally:
            for engine in made:
                engine.close()
