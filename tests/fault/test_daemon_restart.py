"""The daemon crashes, restarts and stalls under a live KvdClient: the engine side never sees
an exception, never waits past its deadline, degrades, and recovers by itself."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvd_client.client import KvdClient
from kvd_proto import kvd_pb2
from kvd_proto.wire import KvLayout
from tests.support.daemon import EXTENT, POOL

pytestmark = [pytest.mark.fault, pytest.mark.multiproc]
DEADLINE = 0.3
SLACK = 0.5


def _client(socket: str) -> KvdClient:
    c = KvdClient(socket, model="restart-model", layout=KvLayout(4096, 1, 4096, 16, "bf16"),
                  deadline_s=DEADLINE)
    assert c.wait_available(10)
    return c


def _store(c: KvdClient, keys: list[bytes]) -> bool:
    res = c.step([kvd_pb2.StepOp(prepare_store=kvd_pb2.PrepareStoreRequest(keys=keys))])
    if res is None:
        return False
    ps = res[0].prepare_store
    c.queue(kvd_pb2.StepOp(complete_store=kvd_pb2.CompleteStoreRequest(
        keys=ps.keys_to_store, success=True, epoch=ps.epoch)))
    return c.flush()


def _hits(c: KvdClient, keys: list[bytes]) -> int | None:
    res = c.step([kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(keys=keys))])
    if res is None:
        return None
    return sum(s == kvd_pb2.BLOCK_STATE_HIT for s in res[0].lookup.states)


def _timed_calls(c: KvdClient, n: int, keys: list[bytes]) -> float:
    worst = 0.0
    for _ in range(n):
        t0 = time.monotonic()
        _hits(c, keys)                      # must not raise
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.02)
    return worst


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_restart_under_traffic(start_daemon, how):
    d = start_daemon("--pool-size", POOL, "--extent-size", EXTENT)
    c = _client(d.socket)
    try:
        keys = [b"k%03d" % i for i in range(16)]
        assert _store(c, keys) and _hits(c, keys) == 16
        d.proc.send_signal(signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
        d.proc.wait(20)
        worst = _timed_calls(c, 20, keys)
        assert worst < DEADLINE + SLACK, f"a call blocked {worst:.2f}s with the daemon down"
        assert not c.available
        d2 = start_daemon("--pool-size", POOL, "--extent-size", EXTENT, socket=d.socket)
        t0 = time.monotonic()
        assert c.wait_available(5)
        assert time.monotonic() - t0 < 2.5, "reconnect took longer than ~2 s"
        assert _hits(c, keys) == 0          # a new daemon starts cold
        assert _store(c, keys) and _hits(c, keys) == 16
        assert d2.stats()["sessions"] == 1
    finally:
        c.close()


def test_stopped_daemon_degrades_then_recovers(daemon):
    c = _client(daemon.socket)
    try:
        keys = [b"s%03d" % i for i in range(8)]
        assert _store(c, keys)
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            worst = _timed_calls(c, 10, keys)
            assert worst < DEADLINE + SLACK, f"a call blocked {worst:.2f}s on a stopped daemon"
            assert not c.available
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert c.wait_available(8), "client did not come back after SIGCONT"
        # A stall longer than the liveness timeout ends the old session; the new one sees the
        # blocks that were completed before the stall: nothing lost, nothing duplicated.
        assert _hits(c, keys) == 8
        doc = daemon.stats()
        assert doc["blocks"]["storing"] == 0 and doc["stats"]["pins"] == 0
    finally:
        c.close()
