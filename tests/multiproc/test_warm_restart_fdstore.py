"""Warm restart through systemd's file-descriptor store (restart.store = "systemd"), with this
test playing systemd's side of the protocol: it owns NOTIFY_SOCKET, keeps the descriptors the
daemon stores (FDSTORE=1, FDNAME=) and forgets the ones it removes (FDSTOREREMOVE=1), and
starts the next daemon the way systemd does after `systemctl restart` or a crash: the stored
descriptors at 3, 4, ... with LISTEN_FDS, LISTEN_FDNAMES and LISTEN_PID.

The pool stays a sealed memfd, so engines of any allowed uid keep being served; blocks stored
before the SIGKILL are adopted and load byte for byte after it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvd_proto import kvd_pb2
from tests.support.daemon import PY, ROOT, clean_env
from tests.support.engine import Engine, block_bytes_of, keys_for
from tests.support.systemd import LAUNCHER, FakeSystemd
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc
MODEL = "fdstore-model"

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
