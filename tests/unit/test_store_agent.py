"""The store agent: the cluster store's client in a child process, so that a client which holds
the GIL, hangs or crashes costs the daemon a failed call and never a frozen process. Real
agent processes, with the stores of tests/support/agent_stores.py built in them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from kvd_server.tiers.cluster.store import StoreError, StoreUnavailable
from kvd_server.tiers.cluster.store_agent import (
    FRAME,
    MAX_VALUE,
    AgentStore,
    WireError,
    recv_frame,
)
from tests.support.daemon import ROOT
from tests.support.waits import wait_until

FACTORY = "tests.support.agent_stores:memory"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


class Ticker:
    """A thread that wakes every 10 ms and records its longest gap: how long this process
    could not run Python (a held GIL stalls it)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(0.01):
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.longest


@pytest.fixture
def agent() -> Iterator[AgentStore]:
    store = AgentStore(FACTORY, {}, threads=4, call_wait_s=10)
    try:
        yield store
    finally:
        store.close()


def test_calls_round_trip_byte_exact_from_many_threads(agent):
    big = os.urandom(2 << 20)
    agent.put("kvd/big", big)
    assert agent.get("kvd/big") == big
    assert agent.get("kvd/absent") is None
    assert agent.healthy()
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(50):
                value = f"{t}:{i}".encode() * (1 + i)
                agent.put(f"kvd/t{t}/{i}", value)
                assert agent.get(f"kvd/t{t}/{i}") == value
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and not any(t.is_alive() for t in threads)
    agent.remove_prefix("kvd/t3/")
    assert agent.get("kvd/t3/7") is None and agent.get("kvd/t4/7") is not None


def test_a_store_error_comes_back_with_its_code_and_the_agent_serves_on(agent):
    with pytest.raises(StoreError, match="refused fail-me") as err:
        agent.put("fail-me", b"x")
    assert err.value.code == -704
    agent.put("kvd/after", b"y")
    assert agent.get("kvd/after") == b"y"


def test_a_set_up_holding_the_gil_never_stalls_the_daemon():
    """Mooncake's set-up holds the GIL while it retries a master that is down (90 s): in the
    agent's process that stalls nobody here."""
    ticker = Ticker()
    t0 = time.monotonic()
    store = AgentStore(FACTORY, {"hold_gil_s": 2.0})
    took = time.monotonic() - t0
    longest = ticker.stop()
    try:
        assert took >= 2.0
        assert longest < 0.5, f"this process stalled {longest:.2f}s while the agent set up"
        store.put("kvd/a", b"a")
        assert store.get("kvd/a") == b"a"
    finally:
        store.close()


def test_a_set_up_that_fails_or_never_ends_is_unavailable_with_the_reason():
    with pytest.raises(StoreUnavailable, match="master is down") as err:
        AgentStore(FACTORY, {"fail": "master is down"})
    assert err.value.code == -1
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="did not set up in 1s"):
        AgentStore(FACTORY, {"hang": True}, connect_wait_s=1.0)
    assert time.monotonic() - t0 < 10
    with pytest.raises(StoreUnavailable, match="ModuleNotFoundError|No module"):
        AgentStore("no_such_module:make", {})


# What Mooncake's client logged when its set-up could not find a LAN address (a container
# with loopback only): ~900 lines in all, the cause in the first error line.
_LAN = [
    "WARNING: Logging before InitGoogleLogging() is written to STDERR",
    "I1129 00:55:33.475910  5208 transfer_engine_impl.cpp:116] Transfer Engine "
    "parseHostNameWithPort. server_name: 127.0.0.1 port: 13588",
    "E1129 00:55:33.476007  5208 transfer_engine_impl.cpp:166] not valid LAN address found",
    "E1129 00:55:33.476011  5208 client_service.cpp:853] Failed to initialize transfer "
    "engine, rc=-1",
    "W1129 00:55:33.476578  5208 real_client.cpp:858] Failed to create client on port 13588, "
    "retry 1/20",
] * 150 + ["E1129 00:55:35.476012  5208 real_client.cpp:865] Failed to create client after "
           "20 retries"]


def test_a_failed_set_up_names_the_cause_its_client_logged(capfd):
    """Mooncake answers a failed set-up with a bare -1 and logs why among hundreds of lines:
    the failure names the first error line (the cause), how many, and the last, bounded; every
    line still reaches the daemon's stderr."""
    with pytest.raises(StoreUnavailable) as err:
        AgentStore(FACTORY, {"log": _LAN, "fail": "Mooncake's set-up failed (code -1)"})
    message = str(err.value)
    assert message.startswith("Mooncake's set-up failed (code -1); its client logged: not "
                              "valid LAN address found [transfer_engine_impl.cpp:166]"), message
    assert "first of 301 error lines" in message
    assert "last: Failed to create client after 20 retries [real_client.cpp:865]" in message
    assert "is the master" not in message and len(message) < 700, message
    passed_on = capfd.readouterr().err
    assert passed_on.count("not valid LAN address found") == 150


def test_a_failed_call_names_the_cause_its_client_logged(agent):
    with pytest.raises(StoreError) as err:
        agent.put("logfail-1", b"x")
    assert err.value.code == -800
    assert str(err.value) == ("put logfail-1: code -800; its client logged: Failed to open "
                              "segment for logfail-1: connection reset by peer "
                              "[transfer_task.cpp:77]")
    with pytest.raises(StoreError, match="refused fail-2$"):   # nothing logged: nothing added
        agent.put("fail-2", b"x")


def test_a_crash_in_the_client_fails_the_call_at_once_and_every_later_one(agent):
    pid = agent.pid
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="exited"):
        agent.get("crash-now")
    assert time.monotonic() - t0 < 5
    with pytest.raises(StoreError, match="exited"):
        agent.put("kvd/x", b"x")
    assert not _alive(pid)


def test_a_call_that_never_returns_times_out_and_the_agent_is_killed():
    store = AgentStore(FACTORY, {}, call_wait_s=1.0)
    pid = store.pid
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="did not answer in 1s"):
            store.get("hang-forever")
        assert time.monotonic() - t0 < 5
        wait_until(lambda: not _alive(pid), 10, "the hung agent to be killed")
        with pytest.raises(StoreError):
            store.get("kvd/x")
    finally:
        store.close()


def test_close_lets_the_agent_leave_and_exit():
    store = AgentStore(FACTORY, {})
    pid = store.pid
    store.close()
    assert not _alive(pid)
    with pytest.raises(StoreError, match="closed"):
        store.get("kvd/x")
    store.close()                                       # twice: nothing more


def test_the_agent_exits_when_the_daemon_dies():
    """SIGKILL of the process that started it: the agent sees its socket's end of file (or
    its parent change) and exits; no orphan keeps the store's segment."""
    code = ("import sys; from kvd_server.tiers.cluster.store_agent import AgentStore; "
            f"s = AgentStore({FACTORY!r}, {{}}); print(s.pid, flush=True); "
            "sys.stdin.read()")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert _alive(pid)
        parent.kill()
        parent.wait(10)
        wait_until(lambda: not _alive(pid), 10, "the orphaned agent to exit")
    finally:
        parent.kill()
        parent.wait(10)


def test_a_frame_that_is_not_one_is_refused():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(FRAME.pack(1, 2, 0, MAX_VALUE + 1))
        with pytest.raises(WireError, match="at most"):
            recv_frame(ours, request=False)
        theirs.sendall(FRAME.pack(1, 2, 1 << 20, 0))
        with pytest.raises(WireError, match="a name of"):
            recv_frame(ours, request=True)
        theirs.sendall(FRAME.pack(1, 0, 0, 10) + b"abc")
        theirs.close()
        with pytest.raises(WireError, match="end of file inside a frame"):
            recv_frame(ours, request=False)
