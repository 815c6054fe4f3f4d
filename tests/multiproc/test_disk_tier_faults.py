"""The disk tier on a filesystem that misbehaves for real (a loop-mounted ext4 image or a small
tmpfs, made for each test; no mocks, no injected errors: the daemon meets the kernel's own
ENOSPC, EIO and EROFS): the tier degrades and says why, the pool and the engines carry on
(stores and loads byte-exact), and a block the disk held comes back byte-exact or reads MISS,
never with wrong bytes and never stuck.

Needs root and a kernel that lets the test mount filesystems; skipped with the reason
otherwise (tests/support/loopfs.py probes it).

The engines keep no evicted blocks in their reserves (`keep_evicted=False`): every block the
pool evicted is then the disk's to serve or not, which is what is checked.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvd_client.offload.session import Lookup, OffloadSession
from kvd_server.tiers.disk.tier import DATA_FILE
from kvd_server.units import format_size
from tests.support.daemon import HEARTBEAT, LIVENESS, Daemon, clean_env
from tests.support.disk_tier import fill_tier as _fill_tier
from tests.support.disk_tier import settled as _settled
from tests.support.disk_tier import tier_of as _tier
from tests.support.engine import keys_for
from tests.support.loopfs import MountedFs, mounted, unavailable
from tests.support.offload_engine import (
    close_session,
    open_session,
    read_back,
    store,
)
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc
MODEL = "disk-fault-model"
POOL = "8MiB"                 # 128 blocks of 64 KiB
POOL_BLOCKS = 128
TIER = 32 << 20               # 512 blocks: what these tests store below fits
TIER_EXTENT = 4 << 20
FS = 64 << 20                 # the filesystem under the tier (room for TIER and then some)
BATCH = 32
READ_S = 20.0                 # bound on one batch's promotions (each read is given up at 10 s)
WAIT_S = 20.0
RETRY_S = 3.0                 # tiers.disk.retry_interval here (the default, 30 s, is long)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def make_fs(tmp_path: Path) -> Iterator[Callable[..., MountedFs]]:
    """Factory: a real filesystem under tmp_path (`mounted`'s arguments), unmounted and its
    loop device detached at teardown, whatever the test did (an error at teardown if it
    would not unmount). Skips (with the reason) where this process may not mount one. Ask
    for it before `start_daemon`, so that the daemons stop (and let go of their files)
    before it unmounts."""
    names = itertools.count()
    with contextlib.ExitStack() as stack:

        def make(fstype: str = "ext4", size: int = FS, **kwargs: Any) -> MountedFs:
            why = unavailable(fstype)
            if why is not None:
                pytest.skip(why)
            return stack.enter_context(
                mounted(tmp_path / f"fs{next(names)}", fstype, size, **kwargs))

        yield make


# ---------------------------------------------------------------------------- helpers


def _env(disk: Path, size: int = TIER) -> dict[str, str]:
    return clean_env(KVD_MANAGER_HEARTBEAT_INTERVAL=HEARTBEAT,
                     KVD_MANAGER_LIVENESS_TIMEOUT=LIVENESS, KVD_SERVER_DRAIN_TIMEOUT="5s",
                     KVD_TIERS_DISK_PATH=str(disk), KVD_TIERS_DISK_SIZE=str(size),
                     KVD_TIERS_DISK_EXTENT_SIZE=str(TIER_EXTENT),
                     KVD_TIERS_DISK_RETRY_INTERVAL=f"{RETRY_S}s")


def _start(start_daemon: Callable[..., Daemon], disk: Path, size: int = TIER) -> Daemon:
    return start_daemon("--pool-size", POOL, "--extent-size", "4MiB", env=_env(disk, size))


def _health_is(daemon: Daemon, health: str) -> Callable[[], bool]:
    return lambda: _tier(daemon)["health"] == health


def _store_all(session: OffloadSession, keys: Sequence[bytes]) -> None:
    for i in range(0, len(keys), BATCH):
        assert store(session, keys[i:i + BATCH]) is not None


def _pool_serves(session: OffloadSession, seed: str) -> None:
    """The pool and an engine carry on: new blocks store, look up HIT and load byte-exact."""
    keys = keys_for(seed, BATCH)
    assert store(session, keys) is not None
    states = [session.lookup(k) for k in keys]
    assert states == [Lookup.HIT] * len(keys), states
    assert read_back(session, keys, BATCH, READ_S) == (len(keys), 0)


def _says_degraded(daemon: Daemon, words: str) -> None:
    """`kvd stats` and `kvd health` say the tier is degraded and why; the daemon serves."""
    text = daemon.kvd("stats").stdout
    # (`kvd stats` wraps a long reason over lines: read it as one)
    assert "# tier disk" in text and f"degraded: {words}" in " ".join(text.split()), text
    health = wait_until(lambda: (lambda out: out if "tier disk" in out.stdout else None)(
        daemon.kvd("health")), 10, "`kvd health` to name the degraded tier")
    assert health.returncode == 0, health
    assert health.stdout.splitlines()[0] == "SERVING"
    assert "tier disk: NOT_SERVING" in health.stdout


# -------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("fstype", ["ext4", "tmpfs"])
def test_a_tier_larger_than_its_filesystem_degrades_at_start_and_the_pool_serves(
        make_fs, start_daemon, fstype):
    fs = make_fs(fstype, 16 << 20)
    daemon = _start(start_daemon, fs.path / "disk", size=TIER)   # twice the filesystem
    wait_until(_health_is(daemon, "degraded"), WAIT_S,
               "the disk tier to find its filesystem too small",
               detail=lambda: _tier(daemon))
    # Not "disk full": the filesystem is empty, and smaller than the tier; both numbers said.
    st = os.statvfs(fs.path)
    reason = (f"filesystem too small for tiers.disk.size: {format_size(st.f_blocks * st.f_frsize)}"
              f" in all, tiers.disk.size is {format_size(TIER)}")
    tier = _tier(daemon)
    assert tier["reason"] == reason, tier
    assert tier["blocks"] == 0
    assert "disk tier" in daemon.log() and reason in daemon.log()
    _says_degraded(daemon, reason)

    session = open_session(daemon.socket, MODEL, reserve=64, keep_evicted=False)
    try:
        keys = keys_for(f"full-at-start-{fstype}", 3 * POOL_BLOCKS)
        _store_all(session, keys)                 # three times the pool: evictions
        assert read_back(session, keys[-BATCH:], BATCH, READ_S) == (BATCH, 0)
        # What the pool evicted was refused by the tier (not written, not held below).
        tier = _tier(daemon)
        assert tier["demotions_refused_total"] >= len(keys) - POOL_BLOCKS
        assert tier["demotions_total"] == 0 and tier["below_keys"] == 0
        assert tier["health"] == "degraded"
        _pool_serves(session, f"full-at-start-{fstype}-later")
    finally:
        close_session(session)
    assert daemon.terminate() == 0


def test_a_disk_that_fills_mid_run_degrades_the_tier_and_it_recovers_when_freed(
        make_fs, start_daemon):
    fs = make_fs("ext4", FS, mkfs_args=["-b", "4096"])
    disk = fs.path / "disk"
    daemon = _start(start_daemon, disk)
    wait_until(_health_is(daemon, "ok"), WAIT_S, "the disk tier to open")
    session = open_session(daemon.socket, MODEL, reserve=64, keep_evicted=False)
    try:
        first = keys_for("fills-first", 2 * POOL_BLOCKS)
        below = _fill_tier(daemon, session, first)
        assert _tier(daemon)["failures_total"] == 0

        # Take every byte the filesystem has left: the tier's data file was preallocated,
        # but its journal must grow for each block written.
        fs.fill()
        more = keys_for("fills-more", 4 * POOL_BLOCKS)
        for i in range(0, len(more), BATCH):
            assert store(session, more[i:i + BATCH]) is not None
            if _tier(daemon)["health"] == "degraded":
                break
        wait_until(_health_is(daemon, "degraded"), WAIT_S,
                   "the disk tier to degrade on a full filesystem",
                   detail=lambda: _tier(daemon))
        tier = _tier(daemon)
        assert tier["reason"] == "disk full: No space left on device", tier
        assert tier["failures_total"] >= 1
        _says_degraded(daemon, "disk full: No space left on device")

        # Degraded: what the pool evicts now is refused, counted; the pool carries on.
        refused = tier["demotions_refused_total"]
        demoted = tier["demotions_total"]
        _store_all(session, keys_for("fills-refused", 2 * BATCH))
        tier = _tier(daemon)
        assert tier["demotions_refused_total"] >= refused + 2 * BATCH
        assert tier["demotions_total"] == demoted
        _pool_serves(session, "fills-pool")

        # What the disk held before it filled: never wrong bytes, never stuck; and since a
        # full disk still reads, every block comes back (byte-exact), none reads MISS.
        loaded, missed = read_back(session, first[:below], BATCH, READ_S)
        assert (loaded, missed) == (below, 0)
        wait_until(_settled(daemon), WAIT_S, "the promotions to end")
        assert _tier(daemon)["corrupt_total"] == 0

        # Free the space: retry_interval after its last failure the tier takes a demotion again,
        # by itself (the engine keeps storing new blocks, so the pool keeps evicting).
        fs.unfill()
        rounds = iter(range(10_000))
        recovered: list[bytes] = []

        def recovered_by_itself() -> bool:
            keys = keys_for(f"fills-recovered-{next(rounds)}", BATCH)
            assert store(session, keys) is not None
            recovered.extend(keys)
            tier = _tier(daemon)
            return tier["health"] == "ok" and tier["demotions_total"] > demoted

        wait_until(recovered_by_itself, RETRY_S + WAIT_S, "the tier to recover by itself",
                   interval=0.5, detail=lambda: _tier(daemon))
        _store_all(session, keys_for("fills-after", 2 * POOL_BLOCKS))
        wait_until(_settled(daemon), WAIT_S, "the demotions to be written")
        tier = _tier(daemon)
        assert tier["health"] == "ok" and tier["reason"] == "", tier
        assert tier["demotions_total"] > demoted + POOL_BLOCKS
        # Written again, and read back byte-exact.
        back = recovered[-2 * BATCH:]
        assert read_back(session, back, BATCH, READ_S) == (len(back), 0)
    finally:
        close_session(session)
    assert daemon.terminate() == 0


def test_a_filesystem_shut_down_mid_run_degrades_the_tier_and_reads_end_as_miss(
        make_fs, start_daemon):
    fs = make_fs("ext4", FS, mkfs_args=["-b", "4096"])
    daemon = _start(start_daemon, fs.path / "disk")
    wait_until(_health_is(daemon, "ok"), WAIT_S, "the disk tier to open")
    session = open_session(daemon.socket, MODEL, reserve=64, keep_evicted=False)
    try:
        first = keys_for("shutdown-first", 2 * POOL_BLOCKS)
        below = _fill_tier(daemon, session, first)

        # The drive goes away: every read, write and fsync on the filesystem fails with EIO.
        fs.shutdown()
        assert "shutdown" in fs.options()
        loaded, missed = read_back(session, first[:below], BATCH, READ_S)
        assert (loaded, missed) == (0, below), "a block was served from a shut-down disk"
        wait_until(_settled(daemon), WAIT_S, "the failed promotions to end",
                   detail=lambda: _tier(daemon))
        tier = _tier(daemon)
        assert tier["failures_total"] >= 1 and tier["promotions_total"] == 0
        # Once reads fail the tier names nothing as held below (engines read MISS at once,
        # and no pool block is evicted for a promotion bound to fail).
        assert tier["below_keys"] == 0, "keys on a dead disk still named as held below"

        # Demotions fail too: the tier degrades, naming the error; the pool carries on.
        _store_all(session, keys_for("shutdown-more", 2 * POOL_BLOCKS))
        wait_until(_health_is(daemon, "degraded"), WAIT_S, "the disk tier to degrade",
                   detail=lambda: _tier(daemon))
        tier = _tier(daemon)
        assert tier["reason"] == "I/O error: Input/output error", tier
        assert tier["demotions_refused_total"] > 0
        _says_degraded(daemon, "I/O error: Input/output error")
        _pool_serves(session, "shutdown-pool")
        wait_until(_settled(daemon), WAIT_S, "the tier's queue to drain")
    finally:
        close_session(session)
    # The daemon stops cleanly on a dead disk (and the filesystem unmounts at teardown).
    assert daemon.terminate() == 0


def test_a_filesystem_gone_read_only_mid_run_degrades_demotions_and_still_serves_reads(
        make_fs, start_daemon):
    fs = make_fs("ext4", FS, mkfs_args=["-b", "4096"], options=["errors=remount-ro"])
    if not fs.error_trigger().exists():
        pytest.skip(f"this kernel has no {fs.error_trigger()} (ext4 error injection)")
    daemon = _start(start_daemon, fs.path / "disk")
    wait_until(_health_is(daemon, "ok"), WAIT_S, "the disk tier to open")
    session = open_session(daemon.socket, MODEL, reserve=64, keep_evicted=False)
    try:
        first = keys_for("read-only-first", 2 * POOL_BLOCKS)
        below = _fill_tier(daemon, session, first)

        # An administrator's `mount -o remount,ro` is refused while the daemon holds its data
        # file and journal open for writing (EBUSY): the kernel does not take a filesystem
        # read-only under a writer. What does make it read-only under the daemon is ext4
        # meeting an error with errors=remount-ro (a bad sector in its metadata, say):
        # "emergency_ro", every write then fails with EROFS, reads still work.
        refused = fs.remount("ro")
        if refused.returncode == 0:
            how = "mount -o remount,ro"
        else:
            assert "busy" in refused.stderr, refused.stderr
            fs.trigger_error("kvd test: the filesystem meets an error")
            how = "errors=remount-ro after an ext4 error"
        options = fs.options().split(",")
        assert "ro" in options or "emergency_ro" in options, (how, options)

        _store_all(session, keys_for("read-only-more", 2 * POOL_BLOCKS))
        wait_until(_health_is(daemon, "degraded"), WAIT_S, "the disk tier to degrade",
                   detail=lambda: _tier(daemon))
        tier = _tier(daemon)
        assert tier["reason"] == "read-only filesystem: Read-only file system", tier
        _says_degraded(daemon, "read-only filesystem: Read-only file system")
        _pool_serves(session, "read-only-pool")

        # A read-only disk still serves every block it holds, byte-exact.
        assert read_back(session, first[:below], BATCH, READ_S) == (below, 0)
        wait_until(_settled(daemon), WAIT_S, "the promotions to end")
        tier = _tier(daemon)
        assert tier["promotions_total"] >= below and tier["corrupt_total"] == 0
        assert tier["health"] == "degraded"
    finally:
        close_session(session)
    assert daemon.terminate() == 0


# ------------------------------------------------------------- found by these tests, fixed
# A full disk cut a journal append short without an error (a torn record: replay dropped it
# and every record after it); a failed preallocation kept what it had allocated.


def test_every_block_the_tier_held_when_its_disk_filled_is_found_after_a_restart(
        make_fs, start_daemon):
    # 4 KiB blocks (a page each): the journal append that needs a new block is the one that
    # crosses into a new page, and ext4 writes the part that fits the old page. (Every record
    # here is 94 bytes; none ends on a page boundary between the 175th and the 2222nd.)
    fs = make_fs("ext4", FS, mkfs_args=["-b", "4096"])
    disk = fs.path / "disk"
    daemon = _start(start_daemon, disk)
    wait_until(_health_is(daemon, "ok"), WAIT_S, "the disk tier to open")
    session = open_session(daemon.socket, MODEL, reserve=64, keep_evicted=False)
    try:
        _fill_tier(daemon, session, keys_for("torn-first", 2 * POOL_BLOCKS))
        fs.fill()
        more = keys_for("torn-more", 4 * POOL_BLOCKS)
        for i in range(0, len(more), BATCH):
            assert store(session, more[i:i + BATCH]) is not None
            if _tier(daemon)["health"] == "degraded":
                break
        wait_until(_health_is(daemon, "degraded"), WAIT_S,
                   "the disk tier to degrade on a full filesystem")
        wait_until(_settled(daemon), WAIT_S, "the tier's queue to drain")
        held = _tier(daemon)["blocks"]
    finally:
        close_session(session)
    assert daemon.terminate() == 0
    fs.unfill()

    again = _start(start_daemon, disk)
    wait_until(_health_is(again, "ok"), WAIT_S, "the restarted daemon's tier to open")
    assert _tier(again)["blocks"] == held, "blocks the tier held were lost by the restart"
    assert "after the last intact record dropped" not in again.log()


def test_a_tier_that_could_not_preallocate_leaves_its_filesystem_the_space(
        make_fs, start_daemon):
    fs = make_fs("ext4", 16 << 20)
    before = fs.free_bytes()
    daemon = _start(start_daemon, fs.path / "disk", size=TIER)   # twice the filesystem
    wait_until(_health_is(daemon, "degraded"), WAIT_S,
               "the disk tier to find its filesystem too small")
    taken = os.stat(fs.path / "disk" / DATA_FILE).st_blocks * 512
    assert taken < 1 << 20, (f"the degraded tier's data file holds {taken} bytes of the "
                             f"filesystem's {before} free")


# ----------------------------------------------------- a tier restarted on a read-only disk


def test_a_tier_restarted_on_a_read_only_filesystem_serves_what_it_holds(
        make_fs, start_daemon):
    fs = make_fs("ext4", FS, mkfs_args=["-b", "4096"])
    disk = fs.path / "disk"
    daemon = _start(start_daemon, disk)
    wait_until(_health_is(daemon, "ok"), WAIT_S, "the disk tier to open")
    session = open_session(daemon.socket, MODEL, reserve=64, keep_evicted=False)
    try:
        first = keys_for("ro-restart-first", 2 * POOL_BLOCKS)
        below = _fill_tier(daemon, session, first)
    finally:
        close_session(session)
    assert daemon.terminate() == 0
    # Nothing holds the filesystem open for writing now: a plain remount makes it read-only.
    remounted = fs.remount("ro")
    assert remounted.returncode == 0, remounted.stderr
    assert "ro" in fs.options().split(",")
    journal = (disk / "kvd-disk.journal").read_bytes()

    again = _start(start_daemon, disk)
    reason = "read-only filesystem: Read-only file system: opened read-only, serving what it holds"
    wait_until(lambda: _tier(again)["reason"] == reason, WAIT_S,
               "the tier to open its files read-only", detail=lambda: _tier(again))
    tier = _tier(again)
    assert tier["health"] == "degraded" and tier["blocks"] >= below, tier
    _says_degraded(again, reason)
    session = open_session(again.socket, MODEL, reserve=64, keep_evicted=False)
    try:
        # Every block the disk held comes back (HIT_PENDING, then HIT), byte-exact.
        assert read_back(session, first[:below], BATCH, READ_S) == (below, 0)
        wait_until(_settled(again), WAIT_S, "the promotions to end")
        # Demotions are refused (counted), never attempted; the pool carries on.
        _store_all(session, keys_for("ro-restart-more", 2 * POOL_BLOCKS))
        tier = _tier(again)
        assert tier["demotions_total"] == 0 and tier["demotions_refused_total"] > 0, tier
        assert tier["failures_total"] == 0 and tier["corrupt_total"] == 0, tier
        _pool_serves(session, "ro-restart-pool")
        assert (disk / "kvd-disk.journal").read_bytes() == journal

        # Writable again: retry_interval later the tier opens its files for writing by itself
        # and takes demotions, what it held still there.
        assert fs.remount("rw").returncode == 0
        wait_until(_health_is(again, "ok"), RETRY_S + WAIT_S,
                   "the tier to open its files for writing again",
                   detail=lambda: _tier(again))
        held = _tier(again)["blocks"]
        assert held >= below
        _store_all(session, keys_for("ro-restart-rw", 2 * POOL_BLOCKS))
        wait_until(lambda: _tier(again)["demotions_total"] > 0 and _settled(again)(), WAIT_S,
                   "the tier to write again", detail=lambda: _tier(again))
    finally:
        close_session(session)
    assert again.terminate() == 0
