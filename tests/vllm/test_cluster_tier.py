"""vLLM 0.33's real scheduler on two nodes sharing a Mooncake store (docs/cluster.md): a prompt
one node's engine computed is found by the other node's engine at its first lookup (the store
asked with that step: vLLM's RETRY, the request waits a step), promoted (HIT_PENDING), then
loaded with the writer's bytes; a prompt no node computed costs one step's wait, then MISS."""

from __future__ import annotations

import pytest

from tests.support import mooncake
from tests.support.daemon import HEARTBEAT, LIVENESS, clean_env
from tests.support.waits import wait_until

from .harness import Engine
from .prompts import BS, assert_loaded_bytes, prompt

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(bool(mooncake.unavailable()), reason=mooncake.unavailable())]

BLOCKS = 24




def _node(start_daemon, workdir, master: mooncake.Master, node: str):
    env = clean_env(KVD_MANAGER_HEARTBEAT_INTERVAL=HEARTBEAT,
                    KVD_MANAGER_LIVENESS_TIMEOUT=LIVENESS,
                    KVD_TIERS_CLUSTER_MASTER=master.address,
                    KVD_TIERS_CLUSTER_METADATA_URL=master.metadata_url,
                    KVD_TIERS_CLUSTER_LOCAL_HOSTNAME="127.0.0.1",
                    KVD_TIERS_CLUSTER_SEGMENT_SIZE="32MiB",
                    KVD_TIERS_CLUSTER_BUFFER_SIZE="16MiB", KVD_TIERS_CLUSTER_SIZE="64MiB",
                    KVD_TIERS_CLUSTER_NODE_ID=node)
    daemon = start_daemon("--pool-size", "1MiB", "--extent-size", "256KiB", env=env,
                          socket=str(workdir / f"{node}.sock"))

    def cluster() -> dict:
        return {t["name"]: t for t in daemon.stats()["tiers"]}["cluster"]

    wait_until(lambda: cluster()["health"] == "ok", 30, f"{node}'s cluster tier")
    return daemon, cluster


def test_a_prompt_computed_on_another_node_loads_after_one_step(start_daemon, workdir,
                                                                master):
    a, a_tier = _node(start_daemon, workdir, master, "vllm-a")
    b, b_tier = _node(start_daemon, workdir, master, "vllm-b")
    writer = Engine(a.socket)
    reader = None
    try:
        assert writer.manager.client.wait_available(10)
        tokens = prompt(31, BLOCKS * BS)
        writer.add("w", tokens)
        writer.run(max_steps=500)
        wait_until(lambda: a_tier()["demotions_total"] >= BLOCKS and
                   a_tier()["queue_depth"] == 0, 30, "a's blocks published")

        reader = Engine(b.socket)
        assert reader.manager.client.wait_available(10)
        reader.poison = True                  # every byte it loads must be the writer's
        reader.add("r", tokens + [9])
        reader.run(max_steps=5000)
        hit_blocks = reader.stats.hit_tokens["r"] // BS
        assert hit_blocks == BLOCKS, f"{hit_blocks} of {BLOCKS} blocks came from node a"
        assert_loaded_bytes(reader, tokens, hit_blocks)
        tier = b_tier()
        assert tier["find_calls_total"] >= 1 and tier["found_total"] >= BLOCKS, tier
        assert tier["promotions_total"] >= BLOCKS and tier["corrupt_total"] == 0, tier

        # A prompt no node computed: asked once (one step's wait), then computed here.
        calls = tier["find_calls_total"]
        reader.add("new", prompt(77, BLOCKS * BS))
        reader.run(max_steps=5000)
        assert reader.stats.hit_tokens.get("new", 0) == 0
        assert b_tier()["find_calls_total"] >= calls + 1
        assert not reader.manager.has_pending_work()
    finally:
        writer.close()
        if reader is not None:
            reader.close()
