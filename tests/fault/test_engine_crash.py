"""Engines killed with SIGKILL at random points: the daemon's accounting stays exact and no
block that was not completely written is ever visible.

`KVD_SOAK_ROUNDS` sets the number of rounds (10 in `make test`, 100 in `make soak`).
"""

from __future__ import annotations

import os
import random
import subprocess
import time

import pytest

from kvd_proto import kvd_pb2
from tests.support.daemon import PY, ROOT, clean_env
from tests.support.engine import Engine, block_bytes_of, keys_for
from tests.support.summary import record
from tests.support.waits import wait_until

pytestmark = [pytest.mark.fault, pytest.mark.multiproc]
ROUNDS = int(os.environ.get("KVD_SOAK_ROUNDS", "10"))


def _chaos(socket: str, seed: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([PY, "-m", "tests.fault.chaos", socket, str(seed)], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
    return proc


def _settled(daemon) -> bool:
    doc = daemon.stats()
    return (doc["sessions"] == 0 and doc["stats"]["pins"] == 0 and doc["stats"]["leases"] == 0
            and doc["blocks"]["storing"] == 0 and doc["blocks"]["pinned"] == 0)


def test_random_kills_leave_exact_accounting_and_no_torn_blocks(daemon):
    rng = random.Random(7)
    for round_no in range(ROUNDS):
        procs = [_chaos(daemon.socket, round_no * 10 + i) for i in range(2)]
        time.sleep(rng.uniform(0.05, 0.6))
        for proc in procs:
            proc.kill()                           # SIGKILL mid-whatever
        for proc in procs:
            proc.wait(10)
            record("torn blocks", int(proc.returncode == 3))
            assert proc.returncode != 3, f"round {round_no}: a client read a torn block"
        wait_until(lambda: _settled(daemon), 15,
                   f"round {round_no}: dead sessions' pins, leases and stores to be released")
        doc = daemon.stats()
        pool = doc["pool"]
        record("leaks", abs(pool["total_bytes"] - pool["free_bytes"] - pool["used_bytes"]))
        assert pool["free_bytes"] + pool["used_bytes"] == pool["total_bytes"]
        # every visible block holds exactly what its writer completed
        reader = Engine(daemon.socket, "chaos-model")
        try:
            universe = keys_for("chaos", 64)
            states = reader.lookup(universe).states
            hits = [k for k, s in zip(universe, states, strict=True)
                    if s == kvd_pb2.BLOCK_STATE_HIT]
            if hits:
                for key, data in zip(hits, reader.load(hits), strict=True):
                    record("torn blocks", int(data != block_bytes_of(key)))
                    assert data == block_bytes_of(key), f"round {round_no}: torn block visible"
        finally:
            reader.close()
        record("crash rounds")
    log = daemon.log()
    assert "Traceback" not in log, log[-3000:]
