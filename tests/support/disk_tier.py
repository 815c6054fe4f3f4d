"""A daemon over a disk tier, as the disk-tier, promotion and tier-fault tests start it: a small
pool (so stores evict to the disk), the disk's size and extent, and the environment that turns
the tier on in a directory with the harness's short timeouts; and what those tests read of it
(the tier's stats, waiting for its writes to land, the pids holding its files)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvd_client.offload.session import OffloadSession
from tests.support.daemon import HEARTBEAT, LIVENESS, Daemon, clean_env
from tests.support.offload_engine import store
from tests.support.waits import wait_until

POOL = "8MiB"                 # 128 blocks of 64 KiB
POOL_BLOCKS = 128
DISK = 64 << 20
DISK_EXTENT = 4 << 20
BATCH = 32
WAIT_S = 20.0


def disk_env(disk: Path, **extra: str) -> dict[str, str]:
    """The daemon's environment for a disk tier in directory `disk` (DISK bytes in extents of
    DISK_EXTENT), and `extra` variables."""
    return clean_env(KVD_MANAGER_HEARTBEAT_INTERVAL=HEARTBEAT,
                     KVD_MANAGER_LIVENESS_TIMEOUT=LIVENESS, KVD_SERVER_DRAIN_TIMEOUT="5s",
                     KVD_TIERS_DISK_PATH=str(disk), KVD_TIERS_DISK_SIZE=str(DISK),
                     KVD_TIERS_DISK_EXTENT_SIZE=str(DISK_EXTENT), **extra)


def tier_of(daemon: Daemon) -> dict[str, Any]:
    """The daemon's one tier's stats (`kvd stats --json`'s `tiers[0]`)."""
    (tier,) = daemon.stats()["tiers"]
    return tier


def wait_health(daemon: Daemon, health: str, what: str = "") -> dict[str, Any]:
    """Wait until the tier's health is `health`; its stats then."""
    return wait_until(lambda: (lambda t: t if t["health"] == health else None)(tier_of(daemon)),
                      WAIT_S, what or f"the disk tier to be {health}",
                      detail=lambda: tier_of(daemon))


def settled(daemon: Daemon) -> Callable[[], bool]:
    """Nothing in flight in the tier: no write or read queued, no promotion open."""
    def check() -> bool:
        tier = tier_of(daemon)
        return tier["queue_depth"] == 0 and tier["promotions_open"] == 0
    return check


def fill_tier(daemon: Daemon, session: OffloadSession, keys: Sequence[bytes]) -> int:
    """Store `keys` (more than the pool holds) and wait until what the pool evicted is on
    the disk; how many blocks that is. (No lookup: a lookup of a key below would promote
    it.)"""
    for i in range(0, len(keys), BATCH):
        assert store(session, keys[i:i + BATCH]) is not None
    below = len(keys) - daemon.stats()["blocks"]["ready"]
    assert below > 0, "nothing was evicted"
    wait_until(lambda: tier_of(daemon)["blocks"] >= below and settled(daemon)(), WAIT_S,
               f"{below} blocks to be written to the disk tier",
               detail=lambda: tier_of(daemon))
    return below


def open_paths(pid: int) -> list[str]:
    """What the process's descriptors point at (/proc/PID/fd), as the kernel names them: an
    unlinked file ends in " (deleted)" (its space is freed only once it is closed)."""
    out = []
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            out.append(os.readlink(os.path.join(fd_dir, name)))
        except OSError:              # closed meanwhile
            continue
    return out
