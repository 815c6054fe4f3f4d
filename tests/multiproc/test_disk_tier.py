"""The disk tier under a real daemon: what the pool evicts is written to the disk, byte-exact,
and is still there when the daemon has gone; a tier that cannot use its directory degrades
and the daemon serves on."""

from __future__ import annotations

from kvd_server.tiers import TierKey
from kvd_server.tiers.disk.tier import DiskTier
from tests.support.disk_tier import DISK, DISK_EXTENT, POOL, disk_env
from tests.support.engine import BLOCK, Engine, block_bytes_of, keys_for
from tests.support.waits import wait_until

STORED = 400                  # 25 MiB: three times what the pool holds


def _read(tier: DiskTier, key: TierKey) -> bytes | None:
    dest = bytearray(BLOCK)
    future = tier.promote(key, memoryview(dest))
    return bytes(dest) if future is not None and future.result(timeout=10) else None


def test_evicted_blocks_are_demoted_byte_exact_and_outlive_the_daemon(start_daemon, tmp_path):
    disk = tmp_path / "disk"
    daemon = start_daemon("--pool-size", POOL, "--extent-size", "4MiB", env=disk_env(disk))
    wait_until(lambda: daemon.stats()["tiers"][0]["health"] == "ok", 20,
               "the disk tier to open its files")
    engine = Engine(daemon.socket)
    keys = keys_for("disk-tier", STORED)
    try:
        for i in range(0, STORED, 32):
            engine.store(keys[i:i + 32])
        # (No lookup here: a lookup of a key held only below would promote it.)
        in_pool = daemon.stats()["blocks"]["ready"]
        assert 0 < in_pool < STORED
        demoted = STORED - in_pool

        def written() -> bool:
            (tier,) = daemon.stats()["tiers"]
            return tier["demotions_total"] >= demoted and tier["queue_depth"] == 0

        wait_until(written, 20, "the evicted blocks to be written to the disk tier",
                   detail=lambda: (demoted, daemon.stats()["tiers"][0],
                                   daemon.stats()["blocks"], daemon.log()[-3000:]))
        (tier,) = daemon.stats()["tiers"]
        assert tier["health"] == "ok" and tier["failures_total"] == 0
        assert tier["blocks"] == demoted and tier["demotions_refused_total"] == 0
        assert tier["used_bytes"] == demoted * BLOCK
        text = daemon.kvd("stats").stdout
        assert "# tier disk" in text and f"{demoted} blocks" in text
    finally:
        engine.close()
        assert daemon.terminate() == 0

    # The daemon is gone; its tier's files hold every evicted block, byte-exact, and the
    # pool's own blocks, written down at the clean stop (tiers.disk.flush_on_stop).
    tier = DiskTier(str(disk), DISK, extent_bytes=DISK_EXTENT)
    try:
        held = list(tier._space.by_key)
        assert {k.key for k in held} == set(keys) and len(held) == STORED
        for key in held:
            assert _read(tier, key) == block_bytes_of(key.key), key
        assert tier.stats().corrupt_total == 0
    finally:
        tier.close()


def test_an_unusable_tier_directory_degrades_the_tier_not_the_daemon(start_daemon, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    daemon = start_daemon("--pool-size", POOL, "--extent-size", "4MiB",
                          env=disk_env(blocker / "disk"))
    wait_until(lambda: daemon.stats()["tiers"][0]["health"] == "degraded", 20,
               "the disk tier to find its directory unusable")
    engine = Engine(daemon.socket)
    try:
        keys = keys_for("degraded", 200)
        for i in range(0, 200, 40):
            engine.store(keys[i:i + 40])
        assert engine.load(keys[-8:]) == [block_bytes_of(k) for k in keys[-8:]]
        (tier,) = daemon.stats()["tiers"]
        assert tier["health"] == "degraded" and "Not a directory" in tier["reason"]
        assert tier["demotions_refused_total"] > 0
        assert "disk tier" in daemon.log() and "degraded" in daemon.log()
        # `kvd health`: the daemon serves (exit 0), and says its disk tier does not.
        health = wait_until(lambda: (lambda out: out if "tier disk" in out.stdout else None)(
            daemon.kvd("health")), 10, "kvd health to name the degraded tier")
        assert health.returncode == 0
        assert health.stdout.splitlines()[0] == "SERVING"
        assert "tier disk: NOT_SERVING" in health.stdout
    finally:
        engine.close()
