"""Faults on the fast path (shared index, published epochs, granted slots), with real
processes: an engine stopped with a load in flight while another engine's stores evict the
blocks it reads, the same engine killed while stopped, and the daemon killed under a running
engine and restarted on the same socket.

What must hold: a stopped engine's copy, once it resumes, reads exactly the bytes it looked
up (its slots are not reused while it is stopped, whether its pin reached the daemon or only
its published epoch protects them); a dead engine's holdings come back and the accounting is
exact; a dead daemon costs the engine's scheduler thread no call and no wrong byte, and the
engine serves again from the restarted daemon by itself.

`KVD_SOAK_ROUNDS` sets the rounds (1 in `make test`, 10 in `make soak`).
"""

from __future__ import annotations

import os
import random
import signal

import pytest

from kvd_client.offload.session import Lookup, OffloadSession
from tests.support.engine import block_bytes_of, keys_for
from tests.support.offload_engine import (
    EngineProcess,
    assert_no_slot_leaked,
    close_session,
    count_blocking_calls,
    load,
    namespace,
    open_session,
    read_block,
    reading_engine,
    settle,
    store,
    wait_idle,
    write_block,
)
from tests.support.summary import record
from tests.support.waits import wait_until

pytestmark = [pytest.mark.fault, pytest.mark.multiproc]
MODEL = "index-fault-model"
SMALL_POOL = ("--pool-size", "8MiB", "--extent-size", "2MiB")     # 128 slots of 64 KiB
ROUNDS = max(1, int(os.environ.get("KVD_SOAK_ROUNDS", "10")) // 10)
PIN = ["pin-at-daemon", "epoch-only"]


def _churn(session: OffloadSession, seed: str, n: int, forbidden: set[int],
           stall_s: float = 1.0) -> list[bytes]:
    """Store up to `n` new keys in batches of 16 until the reserve stays short for `stall_s`
    (a stopped reader holds freed slots back); the keys stored. No slot granted may be one
    in `forbidden`."""
    keys = keys_for(seed, n)
    stored: list[bytes] = []
    for i in range(0, n, 16):
        granted = store(session, keys[i:i + 16], stall_s=stall_s)
        if granted is None:
            break
        reused = {o for _, o in granted} & forbidden
        assert not reused, f"slots {sorted(reused)} of a stopped engine's load went to new stores"
        stored += [k for k, _ in granted]
    return stored


def _stopped_reader(daemon, a: OffloadSession, seed: str, pin: str
                    ) -> tuple[EngineProcess, list[bytes], set[int]]:
    """An engine process that looked up 4 HITs, pinned them and has not copied yet, stopped
    (SIGSTOP) and reaped by the daemon for silence (its process lives on)."""
    return reading_engine(daemon, a, MODEL, seed, reported=pin == "pin-at-daemon",
                          stopped=True)


def _check_accounting(daemon, a: OffloadSession, keys: list[bytes]) -> None:
    """What the index shows, what the daemon counts and what the engine completed agree:
    every block stored is resident or was evicted, nothing pinned, storing or held."""
    doc = daemon.stats()
    ns = namespace(doc, MODEL)
    blocks = doc["blocks"]
    assert blocks["pinned"] == 0 and blocks["storing"] == 0, blocks
    assert doc["pool"]["quarantined_pins"] == 0 and doc["pool"]["quarantined_slots"] == 0
    assert ns["stores_completed_total"] - ns["evictions_total"] == blocks["ready"], (ns, blocks)
    hits = sum(a.lookup(k) is Lookup.HIT for k in keys)
    a.end_step()
    assert hits == blocks["ready"], f"the index shows {hits} blocks, the daemon {blocks['ready']}"


@pytest.mark.parametrize("round_", range(ROUNDS))
@pytest.mark.parametrize("pin", PIN)
def test_a_stopped_engine_reads_what_it_looked_up_while_stores_evict(start_daemon, pin, round_):
    daemon = start_daemon(*SMALL_POOL)
    a = open_session(daemon.socket, MODEL, reserve=16)
    seed = f"stop-{pin}-{round_}"
    reader, reading, offsets = _stopped_reader(daemon, a, f"{seed}-ready", pin)
    stored = keys_for(f"{seed}-ready", 8)
    try:
        evictions = namespace(daemon.stats(), MODEL)["evictions_total"]
        stored += _churn(a, f"{seed}-churn", 3 * 128, offsets)
        assert namespace(daemon.stats(), MODEL)["evictions_total"] > evictions, "no eviction"
        states = [a.lookup(k) for k in reading]
        a.end_step()
        if pin == "epoch-only":
            # The daemon never heard of the load: the blocks were evicted, their slots freed
            # while the engine was stopped ... and held back for it.
            assert states == [Lookup.MISS] * 4, states
        else:
            assert states == [Lookup.HIT] * 4, states      # pinned: never evicted
        reader.resume()
        assert reader.ask("read", reading)["match"] == [True] * 4, \
            "the resumed engine copied another key's bytes"
        record("stall checks")
        reader.ask("unpin", reading)
        reader.close()
        wait_until(lambda: not any(daemon.stats()["pool"][k] for k in
                                   ("quarantined_slots", "quarantined_pins")), 10,
                   "what the stopped engine held to come back once it is gone")
        # Its holdings came back: the other engine stores again.
        more = _churn(a, f"{seed}-after", 64, set(), stall_s=10.0)
        assert len(more) == 64, "what the resumed engine held did not come back"
        stored += more
        settle(a)
        _check_accounting(daemon, a, stored)
    finally:
        reader.kill()
        close_session(a)
    assert_no_slot_leaked(daemon, MODEL)


@pytest.mark.parametrize("pin", PIN)
def test_a_stopped_engine_killed_gives_back_what_it_held(start_daemon, pin):
    daemon = start_daemon(*SMALL_POOL)
    a = open_session(daemon.socket, MODEL, reserve=16)
    seed = f"killed-{pin}"
    reader, reading, offsets = _stopped_reader(daemon, a, f"{seed}-ready", pin)
    stored = keys_for(f"{seed}-ready", 8)
    try:
        stored += _churn(a, f"{seed}-churn", 3 * 128, offsets)
        doc = daemon.stats()
        assert doc["pool"]["quarantined_slots"] > 0, "the stopped engine's granted slots"
        if pin == "pin-at-daemon":
            assert doc["pool"]["quarantined_pins"] == 4
        reader.kill()
        wait_until(lambda: not any(daemon.stats()["pool"][k] for k in
                                   ("quarantined_slots", "quarantined_pins")), 10,
                   "what the killed engine held to come back")
        more = _churn(a, f"{seed}-after", 2 * 128, set(), stall_s=10.0)
        assert len(more) == 2 * 128, f"only {len(more)} stored: the dead engine still holds"
        stored += more
        record("stall checks")
        settle(a)
        _check_accounting(daemon, a, stored)
        states, bad = load(a, more[-32:])
        assert states == [Lookup.HIT] * 32 and bad == []
        settle(a)
    finally:
        reader.kill()
        close_session(a)
    wait_idle(daemon)
    assert_no_slot_leaked(daemon, MODEL)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_daemon_killed_mid_traffic_is_survived_and_served_again(start_daemon, round_):
    """The daemon dies (SIGKILL) at a random step of an engine that stores new blocks and
    loads earlier ones every step, with loads pinned and stores reserved but not yet copied.
    Every copy of that step still reads and writes whole blocks (the pool mapping outlives
    the daemon); the engine then answers MISS and stores nothing, without calling the daemon
    on its thread; once a daemon is back on the socket it serves again by itself."""
    rng = random.Random(round_)
    args = ("--pool-size", "16MiB", "--extent-size", "4MiB")
    daemon = start_daemon(*args)
    a = open_session(daemon.socket, MODEL, reserve=32)
    calls = count_blocking_calls(a.client)
    new = iter(keys_for(f"traffic-{round_}", 100_000))
    stored: list[bytes] = []
    verified = 0
    kill_at = rng.randrange(4, 12)

    def step(kill: bool = False) -> list[bytes]:
        """One engine step: load up to 8 earlier blocks, store 8 new ones; the keys whose
        stores this step completed."""
        nonlocal verified
        loading = rng.sample(stored, min(8, len(stored)))
        hits = [k for k in loading if a.lookup(k) is Lookup.HIT]
        pool = a.client.pool
        offsets = a.start_loads(hits)
        granted = a.reserve([next(new) for _ in range(8)]) or []
        if kill:
            daemon.proc.send_signal(signal.SIGKILL)
            daemon.proc.wait(10)
        for key, offset in zip(hits, offsets):            # the workers' copies
            assert offset is not None
            assert read_block(pool, offset) == block_bytes_of(key), "a load read foreign bytes"
            verified += 1
        for key, offset in granted:
            write_block(a, offset, key)
        a.complete_store([k for k, _ in granted])
        a.finish_loads(hits)
        a.end_step()
        return [k for k, _ in granted]

    try:
        for i in range(kill_at):
            stored += step()
            if i < kill_at - 1 and rng.random() < 0.5:
                settle(a)           # else the step's messages may still be in flight
        assert verified > 0 and len(stored) >= 8
        step(kill=True)
        wait_until(lambda: (step(), not a.client.available)[1], 10,
                   "the engine to notice the daemon is gone")
        for _ in range(10):
            assert all(a.lookup(k) is Lookup.MISS for k in stored[-16:])
            assert a.reserve([next(new) for _ in range(4)]) == [], "a store with no daemon"
            a.end_step()
            a.has_pending_work()

        daemon = start_daemon(*args, socket=daemon.socket)
        fresh: list[bytes] = []

        def served() -> bool:
            fresh.extend(step())
            return bool(fresh) and a.available
        wait_until(served, 20, "the engine to store into the restarted daemon")
        settle(a)
        assert all(a.lookup(k) is Lookup.MISS for k in stored[-16:]), "the new daemon is cold"
        for _ in range(5):
            fresh += step()
            settle(a)
        states, bad = load(a, fresh)
        assert states == [Lookup.HIT] * len(fresh) and bad == []
        verified += len(fresh)
        settle(a)
        assert calls[0] == 0, f"{calls[0]} calls to the daemon on the scheduler thread"
        record("index loads verified", verified)
    finally:
        close_session(a)
    assert_no_slot_leaked(daemon, MODEL)
