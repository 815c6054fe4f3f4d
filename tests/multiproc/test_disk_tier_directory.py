"""The disk tier's directory under a running daemon: removed (`rm -rf`), the tier notices
within a few seconds, says so (health, stats, one WARNING), stops writing into files nobody can
find again, closes them (their space goes back to the filesystem), names nothing as held below
and gives the path up, so a second daemon may take it; it tries the path again after
`retry_interval`. A daemon refused a directory another one holds names that one's pid."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from kvd_server.tiers.disk.tier import DATA_FILE, JOURNAL_FILE
from tests.support.daemon import Daemon
from tests.support.disk_tier import (
    BATCH,
    POOL,
    POOL_BLOCKS,
    WAIT_S,
    disk_env,
    fill_tier,
    open_paths,
    settled,
    tier_of,
    wait_health,
)
from tests.support.engine import keys_for
from tests.support.offload_engine import close_session, open_session, read_back, store
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc
MODEL = "directory-model"
RETRY_S = 3.0
SLOW_RETRY_S = 10.0


def _start(start_daemon: Callable[..., Daemon], disk: Path, **extra: str) -> Daemon:
    extra.setdefault("KVD_TIERS_DISK_RETRY_INTERVAL", f"{RETRY_S}s")
    return start_daemon("--pool-size", POOL, "--extent-size", "4MiB",
                        env=disk_env(disk, **extra))


def _tier_files_open(daemon: Daemon) -> list[str]:
    return [p for p in open_paths(daemon.proc.pid)
            if p.rsplit("/", 1)[-1].split(" ")[0] in (DATA_FILE, JOURNAL_FILE)]


def test_a_tier_directory_removed_under_the_daemon_is_noticed_and_given_up(
        start_daemon, tmp_path):
    disk = tmp_path / "disk"
    # Long enough for the second daemon to start before the first tries the path again.
    daemon = _start(start_daemon, disk, KVD_TIERS_DISK_RETRY_INTERVAL=f"{SLOW_RETRY_S}s")
    wait_health(daemon, "ok", "the disk tier to open")
    session = open_session(daemon.socket, MODEL, reserve=64, keep_evicted=False)
    try:
        first = keys_for("removed-first", 2 * POOL_BLOCKS)
        below = fill_tier(daemon, session, first)
        assert len(_tier_files_open(daemon)) == 2

        shutil.rmtree(disk)
        tier = wait_health(daemon, "degraded", "the tier to notice its directory removed")
        assert tier["reason"].startswith("directory removed"), tier
        # The path was given up: a second daemon takes it and serves its tier there (started
        # first, well within the first one's retry_interval).
        other = start_daemon("--pool-size", POOL, "--extent-size", "4MiB",
                             socket=str(tmp_path / "other.sock"), env=disk_env(disk))
        wait_health(other, "ok", "the second daemon's tier to open on the path given up")
        assert str(disk) in tier["reason"]
        log = daemon.log()
        assert "WARNING" in log and "removed while in use" in log, log
        # Its files are closed: the preallocated space is the filesystem's again.
        wait_until(lambda: _tier_files_open(daemon) == [], WAIT_S,
                   "the daemon to close its unlinked files",
                   detail=lambda: _tier_files_open(daemon))
        # What it held is gone with the files: nothing named below, no block counted.
        assert tier["blocks"] == 0 and tier["used_bytes"] == 0, tier
        wait_until(lambda: tier_of(daemon)["below_keys"] == 0, WAIT_S,
                   "the held-below tables to be emptied")
        text = daemon.kvd("stats").stdout
        assert "degraded: directory removed" in " ".join(text.split()), text
        health = daemon.kvd("health")
        assert health.returncode == 0 and "tier disk: NOT_SERVING" in health.stdout, health

        # No writes into files nobody can find: what the first daemon's pool evicts now is
        # refused, and the blocks it held read MISS (never stuck, never wrong).
        demoted = tier_of(daemon)["demotions_total"]
        keys = keys_for("removed-more", 2 * POOL_BLOCKS)
        for j in range(0, len(keys), BATCH):
            assert store(session, keys[j:j + BATCH]) is not None
        tier = tier_of(daemon)
        assert tier["demotions_total"] == demoted
        assert tier["demotions_refused_total"] >= POOL_BLOCKS
        assert read_back(session, first[:below], BATCH, WAIT_S) == (0, below)

        # The first tries the path again after retry_interval and is refused, naming the
        # second daemon's pid.
        tier = wait_until(
            lambda: (lambda t: t if "another kvd daemon" in t["reason"] else None)(
                tier_of(daemon)), SLOW_RETRY_S + WAIT_S,
            "the first daemon to try the path again", detail=lambda: tier_of(daemon))
        assert f"pid {other.proc.pid}" in tier["reason"], tier
        assert other.terminate() == 0
        wait_until(settled(daemon), WAIT_S, "the first daemon's tier to settle")
    finally:
        close_session(session)
    assert daemon.terminate() == 0


def test_with_the_directory_back_the_tier_starts_again_empty(start_daemon, tmp_path):
    """Removed and nothing else there: after retry_interval the tier makes its directory
    again, empty, and takes demotions (the operator cleared it)."""
    disk = tmp_path / "disk"
    daemon = _start(start_daemon, disk)
    wait_health(daemon, "ok", "the disk tier to open")
    session = open_session(daemon.socket, MODEL, reserve=64, keep_evicted=False)
    try:
        fill_tier(daemon, session, keys_for("again-first", 2 * POOL_BLOCKS))
        shutil.rmtree(disk)
        wait_health(daemon, "degraded", "the tier to notice its directory removed")
        wait_health(daemon, "ok", "the tier to open its directory again")
        assert (disk / DATA_FILE).exists()
        below = fill_tier(daemon, session, keys_for("again-more", 2 * POOL_BLOCKS))
        assert tier_of(daemon)["blocks"] >= below
    finally:
        close_session(session)
    assert daemon.terminate() == 0


def test_a_second_daemon_refused_the_directory_names_the_first_ones_pid(
        start_daemon, tmp_path):
    disk = tmp_path / "disk"
    first = _start(start_daemon, disk)
    wait_health(first, "ok", "the disk tier to open")
    second = start_daemon("--pool-size", POOL, "--extent-size", "4MiB",
                          socket=str(tmp_path / "second.sock"), env=disk_env(disk))
    tier = wait_health(second, "degraded", "the second daemon's tier to be refused")
    assert tier["reason"] == f"another kvd daemon (pid {first.proc.pid}) uses {disk}", tier
    assert second.terminate() == 0 and first.terminate() == 0
