"""A clean stop (`kvd drain`, SIGTERM) of a daemon with a disk tier and no warm restart writes
the pool's READY blocks down to the disk (bounded by `tiers.disk.flush_on_stop`, said in the
log), so the next daemon finds them below: HIT_PENDING, then HIT, byte-exact. With
`flush_on_stop = 0` nothing is written at stop; with warm restart on nothing changes (the pool
itself survives). `make soak` does it with a pool of a thousand blocks."""

from __future__ import annotations

import re
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from kvd_client.offload.session import Lookup
from tests.support.daemon import Daemon
from tests.support.disk_tier import (
    BATCH,
    POOL,
    POOL_BLOCKS,
    WAIT_S,
    disk_env,
    fill_tier,
    settled,
    tier_of,
    wait_health,
)
from tests.support.engine import keys_for
from tests.support.offload_engine import close_session, load, open_session, store
from tests.support.promotion import read_back_promoted
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc
MODEL = "clean-stop-model"
WROTE = re.compile(r"disk tier: (\d+) of the pool's (\d+) blocks written at stop")


def _start(start_daemon: Callable[..., Daemon], disk: Path, *args: str, pool: str = POOL,
           **extra: str) -> Daemon:
    daemon = start_daemon("--pool-size", pool, "--extent-size", "4MiB", *args,
                          env=disk_env(disk, **extra))
    wait_health(daemon, "ok", "the disk tier to open")
    return daemon


def _count(line: str, what: str) -> int:
    """The number said before `what` in the write-down's log line (0: not said)."""
    said = re.search(rf"(\d+) {what}", line)
    return int(said[1]) if said else 0


def _stop(daemon: Daemon, how: str) -> None:
    if how == "kvd drain":
        out = daemon.kvd("drain")
        assert out.returncode == 0, out
    else:
        daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=60) == 0


def _fill(daemon: Daemon, seed: str, n: int, *, below: bool = True) -> tuple[list[bytes], int]:
    """Store `n` blocks (the pool keeps the newest, the disk the rest: `below`, waited for;
    else the tier may refuse some); (keys, in the pool)."""
    keys = keys_for(seed, n)
    session = open_session(daemon.socket, MODEL, reserve=64)
    try:
        if below:
            fill_tier(daemon, session, keys)
        else:
            for i in range(0, n, BATCH):
                assert store(session, keys[i:i + BATCH]) is not None
            wait_until(settled(daemon), WAIT_S, "the tier's queue to drain")
    finally:
        close_session(session)
    in_pool = daemon.stats()["blocks"]["ready"]
    assert in_pool > 0
    return keys, in_pool


@pytest.mark.parametrize("how", ["kvd drain", "SIGTERM"])
def test_a_clean_stop_leaves_the_pools_blocks_on_the_disk(start_daemon, tmp_path, how):
    disk = tmp_path / "disk"
    daemon = _start(start_daemon, disk)
    keys, in_pool = _fill(daemon, f"clean-stop-{how}", 2 * POOL_BLOCKS)
    pool_keys = keys[-in_pool:]                     # LRU: the pool kept the newest
    _stop(daemon, how)
    said = WROTE.search(daemon.log())
    assert said is not None, daemon.log()
    assert (int(said[1]), int(said[2])) == (in_pool, in_pool)
    assert "left when the time ran out" not in daemon.log()

    again = _start(start_daemon, disk)
    assert tier_of(again)["blocks"] == len(keys)
    session = open_session(again.socket, MODEL, reserve=64)
    try:
        # The blocks the pool held at stop come back from the disk as any block below does.
        first, wrong = read_back_promoted(session, pool_keys[:64])
        assert set(first.values()) == {Lookup.HIT_PENDING} and wrong == []
    finally:
        close_session(session)
    assert again.terminate() == 0


def test_flush_on_stop_zero_writes_nothing_at_stop(start_daemon, tmp_path):
    disk = tmp_path / "disk"
    daemon = _start(start_daemon, disk, KVD_TIERS_DISK_FLUSH_ON_STOP="0")
    keys, in_pool = _fill(daemon, "no-flush", 2 * POOL_BLOCKS)
    below = len(keys) - in_pool
    _stop(daemon, "SIGTERM")
    assert WROTE.search(daemon.log()) is None
    assert "flush_on_stop = 0" in daemon.log()
    again = _start(start_daemon, disk)
    assert tier_of(again)["blocks"] == below
    assert again.terminate() == 0


def test_the_time_bound_is_kept_and_what_was_left_is_said(start_daemon, tmp_path):
    """A bound far shorter than the pool's writes (a 64 MiB pool, 1 MiB of writes in flight,
    1 ms): the stop goes on and the log says how many were written and how many left."""
    disk = tmp_path / "disk"
    daemon = _start(start_daemon, disk, pool="64MiB", KVD_TIERS_DISK_FLUSH_ON_STOP="1ms",
                    KVD_TIERS_DISK_QUEUE_SIZE="1MiB")
    keys, in_pool = _fill(daemon, "bounded", 1024 + 64, below=False)
    _stop(daemon, "SIGTERM")
    said = WROTE.search(daemon.log())
    assert said is not None, daemon.log()
    written, total = int(said[1]), int(said[2])
    assert total == in_pool and written < in_pool
    line = daemon.log()[said.start():].splitlines()[0]
    left = _count(line, "left when the time ran out")
    assert left > 0, line
    assert written + _count(line, "finishing as the tier closes") + left == in_pool, line


def test_with_warm_restart_the_stop_writes_nothing_and_the_pool_survives(
        start_daemon, tmp_path, workdir):
    disk = tmp_path / "disk"
    state = Path("/dev/shm") / f"kvd-clean-stop-{workdir.name}"
    warm = ("--warm-restart", "--restart-dir", str(state))
    try:
        daemon = _start(start_daemon, disk, *warm)
        keys, in_pool = _fill(daemon, "warm", 2 * POOL_BLOCKS)
        below = len(keys) - in_pool
        _stop(daemon, "SIGTERM")
        assert WROTE.search(daemon.log()) is None
        again = _start(start_daemon, disk, *warm)
        assert tier_of(again)["blocks"] == below
        session = open_session(again.socket, MODEL, reserve=64)
        try:
            states, wrong = load(session, keys[-8:])       # adopted with the pool: HIT now
            assert states == [Lookup.HIT] * 8 and wrong == []
        finally:
            close_session(session)
        assert again.terminate() == 0
    finally:
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.soak
def test_a_large_pool_is_written_down_at_stop_and_read_back_whole(start_daemon, tmp_path):
    disk = tmp_path / "disk"
    daemon = _start(start_daemon, disk, pool="48MiB")
    keys, in_pool = _fill(daemon, "clean-stop-soak", 768 + 128)
    _stop(daemon, "SIGTERM")
    said = WROTE.search(daemon.log())
    assert said is not None and int(said[1]) == in_pool, daemon.log()
    again = _start(start_daemon, disk, pool="48MiB")
    session = open_session(again.socket, MODEL, reserve=64)
    try:
        for i in range(0, in_pool, 64):
            first, wrong = read_back_promoted(session, keys[-in_pool:][i:i + 64])
            assert Lookup.MISS not in first.values() and wrong == []
    finally:
        close_session(session)
    assert again.terminate() == 0
