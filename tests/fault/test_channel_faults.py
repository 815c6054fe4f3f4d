"""The channel under abuse and faults, with real processes and a real daemon.

A hostile client maps its own session's channel and writes into it whatever it likes:
records with random payloads, forged records naming another engine's slots and keys, and then
positions no ring can have. Meanwhile a victim engine in the same namespace stores and loads.
What must hold: the daemon never crashes or hangs, answers what it refuses, ends the hostile
session when its ring breaks, and nothing of the victim changes (its resident blocks, their
bytes, its pins, its stores); once everyone is gone no slot is leaked. (A session may evict
in its own namespace, as any engine of it may, and then store what it likes for the evicted
keys: tenants, not sessions, are the isolation boundary, as on the gRPC path. So the hostile
records here never ask for an eviction, and the check is that none happens.) And the daemon stopped (SIGSTOP) under an
engine that steps flat out costs that engine's steps nothing; resumed, it catches up.

`KVD_SOAK_FUZZ` scales the garbage (1,000 records in `make test`, 10x in `make soak`).
"""

from __future__ import annotations

import os
import random
import signal
import struct
import time

import pytest

from kvd_client.client import KvdClient
from kvd_client.link.channel import Outbox, SessionChannel
from kvd_client.offload.session import Lookup
from kvd_proto import kvd_pb2
from kvd_proto import records as rec
from kvd_proto.channel import DOWN_HEAD, UP_TAIL, record
from tests.support.engine import keys_for
from tests.support.offload_engine import (
    LAYOUT,
    assert_no_slot_leaked,
    close_session,
    count_blocking_calls,
    load,
    namespace,
    open_session,
    settle,
    store,
    write_block,
)
from tests.support.summary import record as count
from tests.support.waits import wait_until

pytestmark = [pytest.mark.fault, pytest.mark.multiproc]
MODEL = "channel-fault-model"
FUZZ = max(1000, int(os.environ.get("KVD_SOAK_FUZZ", "1000")))


class Hostile:
    """A registered session that maps its own channel and writes anything into it."""

    def __init__(self, socket: str) -> None:
        self.client = KvdClient(socket, model=MODEL, layout=LAYOUT, deadline_s=2.0,
                                engine_id=f"hostile-{os.getpid()}")
        assert self.client.wait_available(10)
        index = self.client.map_index()          # a reader of the index, like an engine
        fds = self.client.map_channel()
        assert index is not None and fds is not None
        for fd in index:
            os.close(fd)
        self.channel = SessionChannel(*fds)
        self.outbox = Outbox()

    def send(self, records: list[bytes]) -> None:
        for data in records:
            self.outbox.put(0, data)
        self.outbox.flush(self.channel)

    def drain(self) -> list[rec.DownRecord]:
        return self.channel.receive()

    def close(self) -> None:
        self.channel.close()
        self.client.close()


def _random_record(rng: random.Random, victim_keys: list[bytes], offsets: list[int]) -> bytes:
    """A record of a real kind with a random, forged or truncated payload (never a RESET:
    dropping its namespace's blocks is any session's right, and would hide what is checked)."""
    kind = rng.choice(sorted(set(rec.UP_KINDS) - {rec.RESET}))
    roll = rng.random()
    if roll < 0.4:
        return record(kind, rng.randbytes(rng.randrange(0, 200)))
    keys = rng.sample(victim_keys, rng.randint(1, min(8, len(victim_keys))))
    offs = [rng.choice(offsets) for _ in keys]
    forged = {
        rec.STORE: lambda: rec.encode_store(keys, "x", None, range(len(keys)), offs),
        rec.COMPLETE_STORE: lambda: rec.encode_complete_store(keys, rng.random() < 0.5, "x",
                                                              rng.choice([0, 1, 2**63])),
        rec.PIN: lambda: rec.encode_pin(keys, "x", None, offs),
        rec.COMPLETE_LOAD: lambda: rec.encode_complete_load(keys, "x", rng.choice([0, 7])),
        rec.TOUCH: lambda: rec.encode_touch(keys, "x"),
        rec.REQUEST_FINISHED: lambda: rec.encode_request_finished("x"),
        # No eviction (a store, or a reserve asked with `evict`, may evict the victim's
        # blocks: any session of a namespace may, and then store those keys itself).
        rec.RESERVE: lambda: rec.encode_reserve(rng.randint(0, 64), kept=rng.random() < 0.5),
        rec.TAKE_EVENTS: lambda: rec.encode_take_events(rng.randint(0, 70000)),
        rec.COUNTERS: lambda: rec.encode_counters(5, 3, 2),
        rec.RELEASE_HELD: lambda: rec.encode_release_held("s1-nobody"),
        rec.RETURN_SLOTS: lambda: rec.encode_return_slots(offs),
        rec.PROMOTE: lambda: rec.encode_promote(keys),
        # Another engine's blocks, taken "back" from slots this session does not hold.
        rec.RESTORE: lambda: rec.encode_restore(keys, offs),
        # A hint with a tag of any size, for any request: refused or remembered, never
        # anything the victim sees.
        rec.HINT: lambda: rec.encode_hint("x", "t" * rng.randint(0, 300),
                                          rng.randint(0, (1 << 32) - 1)),
        # Keys to look for in a cluster store (none here: answered FOUND at once).
        rec.FIND: lambda: rec.encode_find(rng.randrange(1 << 64), keys),
    }[kind]()
    if roll > 0.9:                                  # a field cut short
        length = struct.unpack_from("<I", forged)[0]
        cut = rng.randrange(8, length + 1)
        forged = record(kind, forged[8:cut])
    return forged


def test_garbage_in_a_channel_cannot_crash_the_daemon_or_touch_another_engine(start_daemon):
    daemon = start_daemon("--pool-size", "16MiB", "--extent-size", "4MiB")
    victim = open_session(daemon.socket, MODEL, reserve=16)
    hostile = Hostile(daemon.socket)
    rng = random.Random(7)
    try:
        mine = keys_for("victim", 48)
        granted = store(victim, mine)
        assert granted is not None
        offsets = [o for _, o in granted]
        evictions = namespace(daemon.stats(), MODEL)["evictions_total"]
        rejected = 0
        for n in range(0, FUZZ, 100):
            hostile.send([_random_record(rng, mine, offsets) for _ in range(100)])
            wait_until(lambda: hostile.channel.read_position == hostile.channel.writer.tail,
                       20, "the daemon to read the hostile records")
            rejected += sum(isinstance(a, rec.Rejected) for a in hostile.drain())
            count("fuzz cases", 100)
            # The victim still loads every block it stored, byte for byte.
            assert namespace(daemon.stats(), MODEL)["evictions_total"] == evictions
            states, bad = load(victim, mine)
            assert states == [Lookup.HIT] * len(mine) and bad == [], n
            count("isolation checks")
        assert rejected > FUZZ // 10, "the daemon refused almost nothing"
        # Then a ring no producer can have: the daemon ends that session, and only that one.
        closed = daemon.stats()["clients"]["reaped_total"]
        broken = hostile.client.session_id
        struct.pack_into("<Q", hostile.channel._map, UP_TAIL, 2**62)
        os.eventfd_write(hostile.channel.wake_fd, 1)     # in case the daemon is idle
        wait_until(lambda: daemon.stats()["clients"]["reaped_total"] > closed, 20,
                   "the daemon to end the session whose ring broke")
        assert "broke its channel" in daemon.log()
        assert daemon.proc.poll() is None, "the daemon died"
        states, bad = load(victim, mine)
        assert states == [Lookup.HIT] * len(mine) and bad == [] and victim.available
        settle(victim)
        # Its process lives on (this one): what it held (forged pins, grants) stays held
        # until a later session of the process says its copies are done.
        release_held(victim.client, broken)
    finally:
        hostile.close()
        close_session(victim)
    assert_no_slot_leaked(daemon, MODEL)


def release_held(client: KvdClient, session_id: str | None) -> None:
    assert session_id
    results = client.step([kvd_pb2.StepOp(release_held=kvd_pb2.ReleaseHeldRequest(
        session_id=session_id))])
    assert results is not None


def test_a_garbage_head_of_the_answers_ring_ends_only_that_session(start_daemon):
    daemon = start_daemon("--pool-size", "16MiB", "--extent-size", "4MiB")
    hostile = Hostile(daemon.socket)
    victim = open_session(daemon.socket, MODEL, reserve=8)
    try:
        closed = daemon.stats()["clients"]["reaped_total"]
        broken = hostile.client.session_id
        struct.pack_into("<Q", hostile.channel._map, DOWN_HEAD, 2**40)
        hostile.send([rec.encode_reserve(4)])
        os.eventfd_write(hostile.channel.wake_fd, 1)
        wait_until(lambda: daemon.stats()["clients"]["reaped_total"] > closed, 20,
                   "the daemon to end the session whose answers ring broke")
        assert store(victim, keys_for("after", 8)) is not None
        count("isolation checks")
        release_held(victim.client, broken)
    finally:
        hostile.close()
        close_session(victim)
    assert_no_slot_leaked(daemon, MODEL)


def test_a_stopped_daemon_costs_a_flat_out_engine_nothing_and_catches_up(start_daemon):
    daemon = start_daemon("--pool-size", "32MiB", "--extent-size", "4MiB")
    a = open_session(daemon.socket, MODEL, reserve=64, deadline_s=2.0)
    blocking = count_blocking_calls(a.client)
    keys = keys_for("through-a-stop", 4 * 100)       # with the reserve: under the 512 slots
    stored: list[bytes] = []
    worst = 0.0
    try:
        for i in range(100):
            if i == 20:
                os.kill(daemon.proc.pid, signal.SIGSTOP)
            if i == 50:
                os.kill(daemon.proc.pid, signal.SIGCONT)
            started = time.perf_counter()
            granted = a.reserve(keys[4 * i:4 * (i + 1)], f"r{i}")
            for key, offset in granted or ():
                write_block(a, offset, key)
            if granted:
                a.complete_store([k for k, _ in granted], f"r{i}")
                stored += [k for k, _ in granted]
            a.request_finished(f"r{i}")
            a.end_step()
            worst = max(worst, time.perf_counter() - started)
            end = time.perf_counter() + 0.005
            while time.perf_counter() < end:           # the step's own work, flat out
                pass
        count("stall checks")
        assert blocking[0] == 0 and worst < 0.25, f"a step took {worst:.3f}s"
        settle(a)
        wait_until(lambda: namespace(daemon.stats(), MODEL)["stores_completed_total"]
                   >= len(stored), 20, "the daemon to catch up with what it missed")
        states = [a.lookup(k) for k in stored]
        a.end_step()
        assert states.count(Lookup.HIT) == len(stored)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
        close_session(a)
    assert_no_slot_leaked(daemon, MODEL)
