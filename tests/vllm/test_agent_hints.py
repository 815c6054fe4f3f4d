"""Agent sessions' hints through vLLM 0.33's real scheduler (docs/agents.md): a request whose
kv_transfer_params carry {"kvd": {"session", "retain_s"}} keeps its prefix in the pool through
other requests' traffic, where the same prefix without a hint is evicted; with a disk tier, a
prewarm before the resumed turn makes its lookups HIT at once (no HIT_PENDING step)."""

from __future__ import annotations

import pytest

from kvd_proto import kvd_pb2
from kvd_proto.attach import request_tenant_token
from kvd_proto.wire import TENANT_TOKEN_METADATA
from tests.support.daemon import HEARTBEAT, LIVENESS, clean_env
from tests.support.waits import wait_until

from .harness import Engine
from .prompts import BS, assert_loaded_bytes, prompt

pytestmark = [pytest.mark.vllm]

BLOCKS = 48                   # blocks of a prompt
FLOOD = 16                    # other prompts after the agent's: 768 blocks, 3x the pool


def _env(**extra: str) -> dict[str, str]:
    return clean_env(KVD_MANAGER_HEARTBEAT_INTERVAL=HEARTBEAT,
                     KVD_MANAGER_LIVENESS_TIMEOUT=LIVENESS, **extra)


def _pending(engine: Engine) -> int:
    s = engine.manager.session
    return s.lookups_total - s.hits_total - s.misses_total


def _turns(engine: Engine, hint: dict | None) -> tuple[list[int], int]:
    """An agent's first turn (with `hint`), then other requests' traffic; the agent's prefix
    and the blocks of it its next turn hits."""
    agent = prompt(7, BLOCKS * BS)
    engine.add("turn-1", agent, kv_transfer_params=hint)
    engine.run(max_steps=500)
    for i in range(FLOOD):
        engine.add(f"other-{i}", prompt(200 + i, BLOCKS * BS))
        engine.run(max_steps=500)
    engine.add("r", agent + [5], kv_transfer_params=hint)   # the resumed turn
    engine.run(max_steps=2000)
    return agent, engine.stats.hit_tokens["r"] // BS


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_hinted_prefix_survives_other_traffic_and_an_unhinted_one_does_not(start_daemon,
                                                                               policy):
    daemon = start_daemon("--pool-size", "1MiB", "--extent-size", "256KiB",
                          env=_env(KVD_MANAGER_POLICY=policy))
    engine = Engine(daemon.socket)
    try:
        assert engine.manager.client.wait_available(10)
        agent, hit = _turns(engine, {"kvd": {"session": "agent-1", "retain_s": 300}})
        assert hit == BLOCKS, f"{hit} of {BLOCKS} retained blocks hit"
        assert_loaded_bytes(engine, agent, hit)
        row = daemon.stats()["retention"]["tenants"]["default"]
        assert row["retained_blocks"] >= BLOCKS and row["gave_way_blocks_total"] == 0, row
    finally:
        engine.close()
        daemon.close()                # the same socket path: the next daemon takes it
    daemon = start_daemon("--pool-size", "1MiB", "--extent-size", "256KiB",
                          env=_env(KVD_MANAGER_POLICY=policy))
    engine = Engine(daemon.socket)
    try:
        assert engine.manager.client.wait_available(10)
        _, hit = _turns(engine, None)
        assert hit < BLOCKS // 2, f"{hit} blocks hit without a hint: the flood is too small"
    finally:
        engine.close()


def test_a_prewarm_turns_the_resumed_turns_pending_lookups_into_hits(start_daemon, tmp_path):
    env = _env(KVD_TIERS_DISK_PATH=str(tmp_path / "disk"), KVD_TIERS_DISK_SIZE="16MiB",
               KVD_TIERS_DISK_EXTENT_SIZE="1MiB")
    daemon = start_daemon("--pool-size", "1MiB", "--extent-size", "256KiB", env=env)
    wait_until(lambda: daemon.stats()["tiers"][0]["health"] == "ok", 20, "the disk tier")
    hint = {"kvd": {"session": "agent-9", "retain_s": 0.2}}
    engine = Engine(daemon.socket)
    try:
        assert engine.manager.client.wait_available(10)
        agent = prompt(11, BLOCKS * BS)
        engine.add("turn-1", agent, kv_transfer_params=hint)
        engine.run(max_steps=500)
        wait_until(lambda: daemon.stats()["blocks"]["retained"] == 0, 10, "the hint to expire")
        for i in range(FLOOD):
            engine.add(f"other-{i}", prompt(300 + i, BLOCKS * BS))
            engine.run(max_steps=500)
        wait_until(lambda: daemon.stats()["tiers"][0]["queue_depth"] == 0, 20, "demotions")
        token, _ = request_tenant_token(daemon.socket, 5.0)
        answer = daemon.admin().PrewarmAgentSession(
            kvd_pb2.PrewarmAgentSessionRequest(session="agent-9", retain_ms=60_000),
            metadata=((TENANT_TOKEN_METADATA, token),), timeout=5)
        assert answer.promoting_blocks > BLOCKS // 2, answer
        promoting = answer.promoting_blocks
        wait_until(lambda: daemon.stats()["retention"]["tenants"]["default"]
                   ["retained_blocks"] >= promoting, 20, "the prewarmed blocks to land")
        before = _pending(engine)
        engine.add("r", agent + [5], kv_transfer_params=hint)   # the resumed turn
        engine.run(max_steps=2000)
        assert _pending(engine) == before, "the resumed turn saw HIT_PENDING after a prewarm"
        hit = engine.stats.hit_tokens["r"] // BS
        assert hit == BLOCKS, f"{hit} of {BLOCKS} blocks hit after the prewarm"
        assert_loaded_bytes(engine, agent, hit)
        row = daemon.stats()["retention"]["tenants"]["default"]
        assert row["prewarm_hits_total"] == promoting, row
    finally:
        engine.close()
