"""vLLM 0.33's real scheduler over a daemon with a disk tier: a prefix the pool evicted to the
disk is a HIT_PENDING to the scheduler (the request waits, as vLLM does for any pending
block), then a HIT, and the reader loads the writer's bytes."""

from __future__ import annotations

import pytest

from tests.support.daemon import HEARTBEAT, LIVENESS, clean_env
from tests.support.waits import wait_until

from .harness import Engine
from .prompts import BS, assert_loaded_bytes, prompt

pytestmark = [pytest.mark.vllm]

PROMPTS = 8                   # of 48 blocks each: 384 blocks, 1.5x what the pool holds
BLOCKS = 48


def test_a_prefix_evicted_to_disk_waits_for_its_promotion_then_loads_byte_exact(
        start_daemon, tmp_path):
    env = clean_env(KVD_MANAGER_HEARTBEAT_INTERVAL=HEARTBEAT,
                    KVD_MANAGER_LIVENESS_TIMEOUT=LIVENESS,
                    KVD_TIERS_DISK_PATH=str(tmp_path / "disk"), KVD_TIERS_DISK_SIZE="16MiB",
                    KVD_TIERS_DISK_EXTENT_SIZE="1MiB")
    # 1 MiB of 4 KiB slots: 256 blocks of this engine's layout.
    daemon = start_daemon("--pool-size", "1MiB", "--extent-size", "256KiB", env=env)
    writer = Engine(daemon.socket)
    reader = None
    try:
        assert writer.manager.client.wait_available(10)
        prompts = [prompt(100 + i, BLOCKS * BS) for i in range(PROMPTS)]
        for i, tokens in enumerate(prompts):
            writer.add(f"w{i}", tokens)
            writer.run(max_steps=500)

        def on_disk() -> int:
            (tier,) = daemon.stats()["tiers"]
            return tier["blocks"] if tier["queue_depth"] == 0 else 0

        wait_until(lambda: on_disk() > BLOCKS, 20, "the first prompts to be evicted to disk",
                   detail=lambda: (daemon.stats()["tiers"], daemon.stats()["blocks"]))

        reader = Engine(daemon.socket)
        assert reader.manager.client.wait_available(10)
        reader.poison = True
        tokens = prompts[0]                       # the oldest: on the disk only
        reader.add("r", tokens + [9])
        reader.run(max_steps=5000)
        hit_blocks = reader.stats.hit_tokens["r"] // BS
        assert hit_blocks == BLOCKS, f"{hit_blocks} of {BLOCKS} blocks came back from the disk"
        assert_loaded_bytes(reader, tokens, hit_blocks)
        (tier,) = daemon.stats()["tiers"]
        assert tier["promotions_total"] >= BLOCKS and tier["corrupt_total"] == 0
        assert tier["promotions_open"] == 0
        assert not reader.manager.has_pending_work()
    finally:
        writer.close()
        if reader is not None:
            reader.close()
