"""The channel between an engine's scheduler thread and a real daemon, with real processes:
what the engines answer from the index is counted in `kvd stats` as the engines counted it; an
engine that steps flat out (never sleeping, so no other thread of it would run) reaches the
daemon on its own thread, holds its reserve and makes almost no system call; nothing waits
for the daemon."""

from __future__ import annotations

import json
import threading
import time

import pytest

from kvd_client.offload.session import Lookup
from tests.support.engine import keys_for
from tests.support.offload_engine import (
    EngineProcess,
    close_session,
    count_blocking_calls,
    load,
    namespace,
    open_session,
    settle,
    store,
    write_block,
)
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc
MODEL = "channel-model"
STEP_S = 0.001           # a scheduler step's own work, done flat out (vLLM's is 1-5 ms)


def busy(seconds: float) -> None:
    """Work on this thread without giving up the GIL of its own accord (no sleep, no I/O)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_fast_path_lookups_and_hits_show_in_kvd_stats_as_the_engines_counted(daemon):
    a = open_session(daemon.socket, MODEL, reserve=32)
    other = EngineProcess(daemon.socket, MODEL)
    try:
        stored = keys_for("counted", 24)
        assert store(a, stored) is not None
        states, bad = load(a, stored[:16] + keys_for("never", 8))
        assert states == [Lookup.HIT] * 16 + [Lookup.MISS] * 8 and bad == []
        assert other.ask("load", stored[8:] + keys_for("nor", 4))["states"] == \
            ["hit"] * 16 + ["miss"] * 4
        settle(a)
        other.ask("settle")
        mine = (a.lookups_total, a.hits_total, a.misses_total)
        theirs = other.ask("counts")
        want = (mine[0] + theirs["lookups"], mine[1] + theirs["hits"],
                mine[2] + theirs["misses"])
        assert want[1] >= 32 and want[2] >= 12

        def counted():
            doc = json.loads(daemon.kvd("stats", "--json").stdout)
            ns = namespace(doc, MODEL)
            got = (ns["lookups_total"], ns["hits_total"], ns["misses_total"])
            return doc if got == want else None

        doc = wait_until(counted, 20, "the engines' counts in kvd stats")
        assert doc["stats"]["hits_total"] == want[1]
        assert daemon.stats()["rpc"].get("Lookup", {}).get("calls_total", 0) == 0, \
            "the engines looked up through gRPC"
        channels = doc["channels"]
        assert channels["open"] >= 2 and channels["rejected_total"] == 0
        assert channels["records_total"].get("store", 0) >= 1, channels
        assert channels["records_total"].get("counters", 0) >= 1, channels
        text = daemon.kvd("stats").stdout
        assert "channels" in text, text
    finally:
        other.close()
        close_session(a)


def test_an_engine_stepping_flat_out_reaches_the_daemon_on_its_own_thread(daemon):
    a = open_session(daemon.socket, MODEL, reserve=0)   # sized from the store rate
    blocking = count_blocking_calls(a.client)
    assert not any(t.name == "kvd-offload-sender" for t in threading.enumerate())
    steps, per_step = 200, 12
    keys = keys_for("flat-out", steps * per_step)
    stored = 0
    declined = 0
    missing: set[bytes] = set()
    try:
        for i in range(steps):                    # no sleep, no wait: one thread, flat out
            busy(STEP_S)
            new = keys[i * per_step:(i + 1) * per_step]
            granted = a.reserve(new, f"r{i}")
            if granted is None:
                declined += 1
                missing.update(new)           # never stored: a MISS, whatever LRU keeps
            else:
                for key, offset in granted:
                    write_block(a, offset, key)
                a.complete_store([k for k, _ in granted], f"r{i}")
                stored += len(granted)
            a.request_finished(f"r{i}")
            a.end_step()
        assert blocking[0] == 0, "a call to the daemon on the scheduler thread"
        assert declined <= 3, f"{declined} of {steps} steps found the reserve short"
        channel = a._link.channel
        assert channel is not None and channel.wakes <= steps // 10, \
            f"{channel.wakes} eventfd writes in {steps} steps: the daemon should be polling"
        settle(a)
        ready = lambda: namespace(daemon.stats(), MODEL)["stores_completed_total"] == stored  # noqa: E731
        wait_until(ready, 20, "every store the engine made to be completed at the daemon")
        states = [a.lookup(k) for k in keys]
        settle(a)
        # The blocks in the index are HITs; those evicted into this engine's reserve answer
        # HIT_PENDING and are taken back (docs/attach.md, kept blocks), READY once read.
        doc = daemon.stats()
        ready = namespace(doc, MODEL)
        assert states.count(Lookup.HIT_PENDING) == ready["blocks_restored_total"], ready
        assert states.count(Lookup.HIT) + ready["blocks_restored_total"] == \
            doc["blocks"]["ready"] > 0, ready
        newest = [state for key, state in zip(keys[-240:], states[-240:], strict=True)
                  if key not in missing]          # a step the reserve was short stored none
        assert len(newest) >= 240 - 3 * per_step
        assert newest == [Lookup.HIT] * len(newest), "the newest blocks were evicted (LRU)"
    finally:
        close_session(a)
