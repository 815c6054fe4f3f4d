"""Promotion from the disk tier under a real daemon: a key only the disk holds answers
HIT_PENDING at once (from the namespace's "held below" table, no round trip), then HIT through
the shared index, and loads byte-exact; the disk's blocks are found again after a restart; a
block corrupted on disk is dropped, never served."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvd_client.offload.session import Lookup, OffloadSession
from kvd_proto import kvd_pb2
from kvd_server.tiers.disk.tier import DATA_FILE, DiskTier
from tests.support.disk_tier import DISK, DISK_EXTENT, POOL, disk_env
from tests.support.engine import Engine, block_bytes_of, keys_for
from tests.support.offload_engine import (
    assert_no_slot_leaked,
    close_session,
    count_blocking_calls,
    open_session,
    settle,
    store,
)
from tests.support.promotion import STEPS, read_back_promoted, until_hit
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc
MODEL = "test-model"
STORED = 400                  # three times what the pool holds
BATCH = 32                    # keys read back per round (a quarter of the pool)


def _tier(daemon) -> dict:
    (tier,) = daemon.stats()["tiers"]
    return tier


def _daemon_with_a_disk(start_daemon, tmp_path: Path):
    """A daemon over a disk tier in `tmp_path`, once the tier is open."""
    daemon = start_daemon("--pool-size", POOL, "--extent-size", "4MiB",
                          env=disk_env(tmp_path / "disk"))
    wait_until(lambda: _tier(daemon)["health"] == "ok", 20, "the disk tier to open")
    return daemon


def _wait_written(daemon, blocks: int) -> None:
    wait_until(lambda: _tier(daemon)["blocks"] >= blocks and _tier(daemon)["queue_depth"] == 0,
               20, f"{blocks} blocks to be written to the disk tier")


def _fill(daemon, session: OffloadSession, keys: Sequence[bytes]) -> int:
    """Store `keys` (more than the pool holds); how many the disk holds once written (no
    lookup here: a lookup of a key held below would promote it)."""
    for i in range(0, len(keys), BATCH):
        store(session, keys[i:i + BATCH])
    below = len(keys) - daemon.stats()["blocks"]["ready"]
    assert below > 0, "nothing was evicted"
    _wait_written(daemon, below)
    return below


def test_what_only_the_disk_holds_reads_pending_then_hit_and_loads_byte_exact(start_daemon,
                                                                                tmp_path):
    daemon = _daemon_with_a_disk(start_daemon, tmp_path)
    keys = keys_for("promote", STORED)
    session = open_session(daemon.socket, MODEL, reserve=64)
    calls = count_blocking_calls(session.client)
    try:
        below = _fill(daemon, session, keys)
        assert _tier(daemon)["below_keys"] == below
        for i in range(0, STORED, BATCH):
            batch = keys[i:i + BATCH]
            first, bad = read_back_promoted(session, batch)
            assert bad == [], f"{len(bad)} promoted blocks loaded with wrong bytes"
            for k in batch:
                # Not in the pool (any more): its first answer is HIT_PENDING, never MISS.
                assert first[k] in (Lookup.HIT, Lookup.HIT_PENDING)
            if i < below:                 # the oldest blocks went down first
                assert first[batch[0]] is Lookup.HIT_PENDING
        assert calls[0] == 0, f"{calls[0]} calls to the daemon on the scheduler thread"
        tier = _tier(daemon)
        assert tier["promotions_total"] >= below
        assert tier["corrupt_total"] == 0 and tier["failures_total"] == 0
        assert tier["promotions_open"] == 0
        assert not session.has_pending_work()
    finally:
        close_session(session)

    # A gRPC client (no shared index) gets the same: HIT_PENDING, then HIT.
    engine = Engine(daemon.socket)
    try:
        states = engine.lookup(keys).states
        pending = [k for k, s in zip(keys, states, strict=True)
                   if s == kvd_pb2.BLOCK_STATE_HIT_PENDING]
        assert pending, "no key held on disk read HIT_PENDING over gRPC"
        wanted = pending[:BATCH]
        wait_until(lambda: all(s == kvd_pb2.BLOCK_STATE_HIT
                               for s in engine.lookup(wanted).states), 20,
                   "promotions asked over gRPC to finish")
        assert engine.load(wanted) == [block_bytes_of(k) for k in wanted]
    finally:
        engine.close()


def test_the_disk_tier_is_found_again_after_a_restart_and_a_corrupt_block_is_never_served(
        start_daemon, tmp_path):
    disk = tmp_path / "disk"
    daemon = start_daemon("--pool-size", POOL, "--extent-size", "4MiB", env=disk_env(disk))
    wait_until(lambda: _tier(daemon)["health"] == "ok", 20, "the disk tier to open")
    keys = keys_for("restart", STORED)
    session = open_session(daemon.socket, MODEL, reserve=64)
    try:
        _fill(daemon, session, keys)
    finally:
        close_session(session)
    assert daemon.terminate() == 0

    # Corrupt one block where it lies in the tier's data file.
    offline = DiskTier(str(disk), DISK, extent_bytes=DISK_EXTENT)
    try:
        held = {k.key: e.offset for k, e in offline._space.by_key.items()}
    finally:
        offline.close()
    below = [k for k in keys if k in held]
    victim = below[0]
    offset = held[victim]
    fd = os.open(disk / DATA_FILE, os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff" * 512, offset + 4096)
    finally:
        os.close(fd)

    again = start_daemon("--pool-size", POOL, "--extent-size", "4MiB", env=disk_env(disk))
    wait_until(lambda: _tier(again)["health"] == "ok", 20,
               "the restarted daemon's disk tier to open")
    session = open_session(again.socket, MODEL, reserve=64)
    try:
        # The namespace, made when the engine registered, names what the disk held before.
        assert _tier(again)["below_keys"] == len(below)
        # The corrupt block: HIT_PENDING, then MISS once its read failed the checksum.
        assert session.lookup(victim) is Lookup.HIT_PENDING
        session.end_step()
        for _ in range(STEPS):
            state = session.lookup(victim)
            assert state is not Lookup.HIT, "a corrupt block was served"
            session.end_step()
            if state is Lookup.MISS:
                break
            time.sleep(0.002)
        else:
            raise AssertionError("the corrupt block's promotion never ended")
        assert _tier(again)["corrupt_total"] == 1
        good = [k for k in below if k != victim][:2 * BATCH]
        for i in range(0, len(good), BATCH):
            first, bad = read_back_promoted(session, good[i:i + BATCH])
            assert bad == []
            assert set(first.values()) == {Lookup.HIT_PENDING}
    finally:
        close_session(session)


def test_another_namespace_never_sees_the_disks_blocks(start_daemon, tmp_path):
    """The held-below table is the namespace's own: an engine of another model (another
    namespace, as another tenant's would be) reads MISS for every key the disk holds."""
    daemon = _daemon_with_a_disk(start_daemon, tmp_path)
    keys = keys_for("apart", STORED)
    a = open_session(daemon.socket, MODEL, reserve=64)
    b = open_session(daemon.socket, "another-model", reserve=16)
    try:
        _fill(daemon, a, keys)
        states = [b.lookup(k) for k in keys]
        b.end_step()
        assert set(states) == {Lookup.MISS}
        assert _tier(daemon)["promotions_total"] == 0
    finally:
        close_session(a)
        close_session(b)


def test_a_reset_while_promotions_run_serves_nothing_old_and_leaks_no_slot(start_daemon,
                                                                           tmp_path):
    """A reset drops the namespace's blocks on the disk too; promotions in flight at the
    reset finish harmlessly (their slots come back), and nothing from before it is served."""
    daemon = _daemon_with_a_disk(start_daemon, tmp_path)
    keys = keys_for("reset-promote", STORED)
    session = open_session(daemon.socket, MODEL, reserve=64)
    try:
        _fill(daemon, session, keys)
        asked = [k for k in keys[:2 * BATCH] if session.lookup(k) is Lookup.HIT_PENDING]
        assert asked
        session.end_step()                       # the PROMOTE goes; reset right behind it
        session.reset()
        settle(session)
        wait_until(lambda: _tier(daemon)["promotions_open"] == 0, 20,
                   "the promotions to end")
        states = [session.lookup(k) for k in keys]
        session.end_step()
        assert set(states) == {Lookup.MISS}, "a block from before the reset was found"
        tier = _tier(daemon)
        assert tier["blocks"] == 0 and tier["below_keys"] == 0
    finally:
        close_session(session)
    assert_no_slot_leaked(daemon, MODEL)


def test_promotions_go_on_past_the_asks_a_session_remembers(start_daemon, tmp_path,
                                                             monkeypatch):
    """A promoted key reads HIT from the index and never comes back to the session's asks;
    they are still forgotten, so the engine keeps promoting past MAX_ASKED keys (it read
    MISS for every later key until has_pending_work happened to sweep them)."""
    import kvd_client.offload.promotions

    monkeypatch.setattr(kvd_client.offload.promotions, "MAX_ASKED", BATCH + 8)
    daemon = _daemon_with_a_disk(start_daemon, tmp_path)
    keys = keys_for("many-asks", STORED)
    session = open_session(daemon.socket, MODEL, reserve=64)
    try:
        below = _fill(daemon, session, keys)
        assert below > 4 * BATCH
        promoted = 0
        for i in range(0, below, BATCH):          # as vLLM: never has_pending_work
            batch = keys[i:i + BATCH]
            until_hit(session, batch, f" after {promoted} promotions")
            session.start_loads(batch)
            session.finish_loads(batch)
            session.end_step()
            promoted += len(batch)
        assert promoted > kvd_client.offload.promotions.MAX_ASKED
    finally:
        close_session(session)
