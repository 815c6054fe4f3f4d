"""The disk tier's journal damaged between two daemons (a bad sector, a stray write): a corrupt
byte in the middle costs the one record it lies in, not every record after it; the next daemon
says "corrupt record at offset N" (a torn tail, a write cut short, is said as such), serves
every other block byte-exact and rewrites the journal without the damage.
`make soak` corrupts several records at random places, round after round."""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kvd_server.tiers.disk.tier import JOURNAL_FILE
from tests.support.daemon import Daemon
from tests.support.disk_tier import POOL, disk_env, fill_tier, tier_of, wait_health
from tests.support.engine import keys_for
from tests.support.offload_engine import close_session, open_session, read_back

pytestmark = pytest.mark.multiproc
MODEL = "journal-model"
STORED = 3 * 128              # three times the pool: two thirds of it goes to the disk
HEADER = 28                   # the journal's file header (magic, version, data and extent sizes)
CORRUPT = re.compile(r"corrupt record at offset (\d+)")
ROUNDS = min(20, int(os.environ.get("KVD_SOAK_ROUNDS", "4")))


def _start(start_daemon: Callable[..., Daemon], disk: Path) -> Daemon:
    daemon = start_daemon("--pool-size", POOL, "--extent-size", "4MiB", env=disk_env(disk))
    wait_health(daemon, "ok", "the disk tier to open")
    return daemon


def _write_then_kill(start_daemon: Callable[..., Daemon], disk: Path, seed: str
                     ) -> tuple[list[bytes], int]:
    """A daemon stores STORED blocks (what the pool evicts is written to the disk), then is
    SIGKILLed (what it wrote is in the kernel's cache: the journal holds one record per block
    on the disk, and no stop adds to it). (the keys, how many blocks the disk holds)"""
    daemon = _start(start_daemon, disk)
    keys = keys_for(seed, STORED)
    session = open_session(daemon.socket, MODEL, reserve=64)
    try:
        fill_tier(daemon, session, keys)
        held = tier_of(daemon)["blocks"]
    finally:
        close_session(session)
    daemon.proc.kill()
    daemon.proc.wait(timeout=10)
    return keys, held


def _record_starts(journal: bytes, keys: list[bytes]) -> list[int]:
    """Where each record of the journal starts, found without its parser: every record here
    is a PUT of the same size (one namespace, keys of one length), the first right after the
    file header, and each names its key."""
    at = sorted(p for p in (journal.find(k) for k in keys) if p >= 0)
    assert len(at) > 2 and len({b - a for a, b in zip(at, at[1:], strict=False)}) == 1, at[:4]
    to_key = at[0] - HEADER
    return [p - to_key for p in at]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["a record's middle", "a record's first byte"])
def test_a_corrupt_record_in_the_middle_of_the_journal_costs_that_record_alone(
        start_daemon, tmp_path, where):
    disk = tmp_path / "disk"
    keys, held = _write_then_kill(start_daemon, disk, f"journal-{where}")
    path = disk / JOURNAL_FILE
    starts = _record_starts(path.read_bytes(), keys)
    assert len(starts) == held
    middle = len(starts) // 2
    record, size = starts[middle], starts[1] - starts[0]
    _flip(path, record + (size // 2 if where == "a record's middle" else 0))

    again = _start(start_daemon, disk)
    tier = tier_of(again)
    assert tier["blocks"] == held - 1, \
        f"a corrupt record at {middle} of {held} lost {held - tier['blocks']} blocks"
    log = again.log()
    assert [int(n) for n in CORRUPT.findall(log)] == [record], log
    assert "a write cut short" not in log
    session = open_session(again.socket, MODEL, reserve=64)
    try:
        # The pool died with the first daemon: every block comes from the disk, byte-exact
        # (read_back checks each one's bytes), all but the corrupt record's.
        loaded, _ = read_back(session, keys, 32, 20.0)
        assert loaded == held - 1
    finally:
        close_session(session)
    assert again.terminate() == 0
    # The journal was rewritten without the damage: the next start says nothing of it.
    third = _start(start_daemon, disk)
    assert "corrupt record" not in third.log()
    assert third.terminate() == 0


def test_a_torn_tail_is_still_said_to_be_a_write_cut_short(start_daemon, tmp_path):
    disk = tmp_path / "disk"
    _, held = _write_then_kill(start_daemon, disk, "journal-torn")
    path = disk / JOURNAL_FILE
    os.truncate(path, path.stat().st_size - 7)           # the last record cut short
    again = _start(start_daemon, disk)
    assert tier_of(again)["blocks"] == held - 1
    assert "a write cut short" in again.log() and "corrupt record" not in again.log()
    assert again.terminate() == 0


@pytest.mark.soak
def test_scattered_corrupt_records_each_cost_only_themselves_round_after_round(
        start_daemon, tmp_path):
    rng = random.Random(47)
    disk = tmp_path / "disk"
    keys, held = _write_then_kill(start_daemon, disk, "journal-soak")
    path = disk / JOURNAL_FILE
    expected = held
    for r in range(ROUNDS):
        data = path.read_bytes()
        starts = _record_starts(data, keys)
        assert len(starts) == expected
        size = starts[1] - starts[0]
        # Eight records apart from each other (never two bytes in one record), anywhere past
        # the file header: each of their bytes, any one.
        picked = sorted(rng.sample(range(1, len(starts) // 2), 8))
        records = [starts[2 * i] for i in picked]
        for record in records:
            _flip(path, record + rng.randrange(size))
        again = _start(start_daemon, disk)
        expected -= len(records)
        assert tier_of(again)["blocks"] == expected, f"round {r}"
        assert sorted(int(n) for n in CORRUPT.findall(again.log())) == records
        session = open_session(again.socket, MODEL, reserve=64)
        try:
            loaded, _ = read_back(session, keys, 32, 20.0)
            assert loaded == expected
        finally:
            close_session(session)
        again.proc.kill()             # no stop: the journal holds the disk's blocks only
        again.proc.wait(timeout=10)
