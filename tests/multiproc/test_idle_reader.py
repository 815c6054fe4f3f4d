"""An idle reader that holds back slot reuse is named, with a real daemon and real engines.

Every slot the daemon frees in a namespace whose index engines read waits in limbo until each
reader's published epoch has moved past it. A reader that published once and went idle (here:
an engine process with a load in flight that never finishes it, running or stopped and reaped)
stalls every writer of its namespace, and nothing used to say who. What must hold: kvd stats
(JSON and text), ListSessions and `kvd sessions` name the session holding reuse back in each
namespace, its pid and for how long; the daemon logs a WARNING naming it once it has held
writers back for a few seconds, rate-limited (not once per sweep); once it moves on (or its
process is gone) nobody is named and the writer stores again.

`KVD_SOAK_LOAD_S` sets how long the soak variant holds (`make soak`).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest

from kvd_proto import kvd_pb2
from tests.support.engine import keys_for
from tests.support.offload_engine import (
    EngineProcess,
    close_session,
    namespace,
    open_session,
    reading_engine,
    store,
)
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc
MODEL = "idle-reader-model"
SMALL_POOL = ("--pool-size", "8MiB", "--extent-size", "2MiB")     # 128 slots of 64 KiB
WARN_WITHIN_S = 15.0      # the daemon warns after a few seconds of holding, checked per sweep
SOAK_S = float(os.environ.get("KVD_SOAK_LOAD_S", "30"))


def _holding_reader(daemon: Any, a: Any, seed: str, stopped: bool) -> tuple[EngineProcess, list]:
    """An engine process that looked up 4 HITs and pinned them (its published epoch stays
    while the load is in flight), then goes idle; `stopped`: it is also stopped (SIGSTOP) and
    reaped, so an ended session whose process lives on holds."""
    reader, reading, _ = reading_engine(daemon, a, MODEL, seed, reported=True, stopped=stopped)
    return reader, reading


def _stall(a: Any, seed: str) -> int:
    """Store batches of 16 new keys until the reserve stays short for a second (every free
    slot went to limbo behind the reader): the keys stored."""
    keys = keys_for(seed, 4 * 128)
    for i in range(0, len(keys), 16):
        if store(a, keys[i:i + 16], stall_s=1.0) is None:
            return i
    raise AssertionError("the writer never stalled: nothing holds reuse back")


def _holder(daemon: Any) -> dict[str, Any]:
    return namespace(daemon.stats(), MODEL).get("reclaim_holder") or {}


def _warnings(daemon: Any, session_id: str) -> list[str]:
    return [line for line in daemon.log().splitlines()
            if " WARNING " in line and session_id in line]


def _check_named(daemon: Any, reader: EngineProcess, live: bool) -> dict[str, Any]:
    """Stats, ListSessions, `kvd stats` and `kvd sessions` name the reader; its holder row."""
    session_id = reader.hello["session"]
    holder = wait_until(lambda: _holder(daemon).get("session_id") == session_id
                        and _holder(daemon), 10, "kvd stats to name the holding reader")
    assert holder["pid"] == reader.pid
    assert holder["live"] is live
    assert holder["slots_waiting"] > 0
    assert holder["held_seconds"] > 0
    later = _holder(daemon)
    assert later["held_seconds"] >= holder["held_seconds"], "the time held goes on"

    ns_id = namespace(daemon.stats(), MODEL)["id"]
    listed = daemon.admin().ListSessions(kvd_pb2.ListSessionsRequest(), timeout=5)
    rows = [h for h in listed.reclaim_holders if h.namespace_id == ns_id]
    assert len(rows) == 1, listed.reclaim_holders
    assert rows[0].session_id == session_id and rows[0].pid == reader.pid
    assert rows[0].held_seconds > 0 and rows[0].slots_waiting > 0 and rows[0].live is live

    text = daemon.kvd("stats").stdout
    assert re.search(rf"{re.escape(session_id)}\b.*pid {reader.pid}\b", text), text
    text = daemon.kvd("sessions").stdout
    assert re.search(rf"{re.escape(session_id)}\b.*pid {reader.pid}\b", text), text
    return holder


@pytest.mark.parametrize("stopped", [False, True], ids=["idle", "stopped-and-reaped"])
def test_the_reader_holding_reuse_back_is_named_and_warned_about(start_daemon, stopped):
    daemon = start_daemon(*SMALL_POOL)
    a = open_session(daemon.socket, MODEL, reserve=16)
    reader, reading = _holding_reader(daemon, a, f"named-{stopped}", stopped)
    session_id = reader.hello["session"]
    try:
        assert not _warnings(daemon, session_id)
        stalled_at = time.monotonic()
        _stall(a, f"churn-{stopped}")
        _check_named(daemon, reader, live=not stopped)
        wait_until(lambda: _warnings(daemon, session_id), WARN_WITHIN_S,
                   "a WARNING naming the holding session")
        line = _warnings(daemon, session_id)[0]
        assert f"pid {reader.pid}" in line, line
        assert time.monotonic() - stalled_at >= 2.0, "warned before it held for seconds"
        time.sleep(2.0)             # 20 sweeps: still one warning (rate-limited)
        assert len(_warnings(daemon, session_id)) == 1, _warnings(daemon, session_id)

        # It moves on (finishes its load) or its process is gone: nobody holds, the writer
        # stores again.
        if stopped:
            reader.kill()
        else:
            reader.ask("unpin", reading)
            reader.ask("end_step")
        wait_until(lambda: not _holder(daemon).get("session_id"), 10,
                   "the holder to be cleared once the reader moved on")
        listed = daemon.admin().ListSessions(kvd_pb2.ListSessionsRequest(), timeout=5)
        assert not listed.reclaim_holders
        assert store(a, keys_for(f"after-{stopped}", 16), stall_s=10.0) is not None
    finally:
        reader.kill()
        close_session(a)


@pytest.mark.soak
def test_soak_a_long_hold_is_warned_about_at_a_bounded_rate(start_daemon):
    """KVD_SOAK_LOAD_S (at least 65) seconds of holding: the time held keeps growing in
    stats, the warnings come at most once a minute, and the writer recovers afterwards."""
    hold_s = max(SOAK_S, 65.0)
    daemon = start_daemon(*SMALL_POOL)
    a = open_session(daemon.socket, MODEL, reserve=16)
    reader, reading = _holding_reader(daemon, a, "soak", stopped=False)
    session_id = reader.hello["session"]
    try:
        _stall(a, "soak-churn")
        started = time.monotonic()
        held = [_check_named(daemon, reader, live=True)["held_seconds"]]
        while time.monotonic() - started < hold_s:
            time.sleep(5)
            held.append(_holder(daemon)["held_seconds"])
            # The writer keeps trying (and keeps being refused) meanwhile.
            assert store(a, keys_for(f"soak-try-{len(held)}", 16), stall_s=0.5) is None
        assert held == sorted(held) and held[-1] >= hold_s - 5, held
        warnings = _warnings(daemon, session_id)
        assert 1 <= len(warnings) <= 1 + int(held[-1] // 60), warnings
        reader.ask("unpin", reading)
        reader.ask("end_step")
        wait_until(lambda: not _holder(daemon).get("session_id"), 10, "the holder to clear")
        after = keys_for("soak-after", 64)
        for i in range(0, 64, 16):          # a reserve of 16: as many a step
            assert store(a, after[i:i + 16], stall_s=10.0) is not None
    finally:
        reader.kill()
        close_session(a)
