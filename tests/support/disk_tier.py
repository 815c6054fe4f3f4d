"""A daemon over a disk tier, as the disk-tier, promotion and tier-fault tests start it: a small
pool (so stores evict to the disk), the disk's size and extent, and the environment that turns
the tier on in a directory with the harness's short timeouts."""

from __future__ import annotations

from pathlib import Path

from tests.support.daemon import HEARTBEAT, LIVENESS, clean_env

POOL = "8MiB"                 # 128 blocks of 64 KiB
DISK = 64 << 20
DISK_EXTENT = 4 << 20


def disk_env(disk: Path) -> dict[str, str]:
    """The daemon's environment for a disk tier in directory `disk` (DISK bytes in extents of
    DISK_EXTENT)."""
    return clean_env(KVD_MANAGER_HEARTBEAT_INTERVAL=HEARTBEAT,
                     KVD_MANAGER_LIVENESS_TIMEOUT=LIVENESS, KVD_SERVER_DRAIN_TIMEOUT="5s",
                     KVD_TIERS_DISK_PATH=str(disk), KVD_TIERS_DISK_SIZE=str(DISK),
                     KVD_TIERS_DISK_EXTENT_SIZE=str(DISK_EXTENT))
