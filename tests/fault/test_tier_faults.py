"""The daemon SIGKILLed while its disk tier writes (demotions in flight) and while it reads
blocks back into the pool (promotions in flight), round after round on the same directory:
nothing wrong is ever served (every HIT loads its own key's bytes), and what was written
before a kill is found again by the next daemon. `make soak` runs more rounds."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from kvd_client.offload.session import Lookup
from tests.support.disk_tier import POOL, disk_env
from tests.support.engine import keys_for
from tests.support.offload_engine import close_session, open_session, read_back, store
from tests.support.waits import wait_until

pytestmark = [pytest.mark.fault, pytest.mark.multiproc]
MODEL = "tier-fault-model"
ROUNDS = min(40, int(os.environ.get("KVD_SOAK_ROUNDS", "4")))
PER_ROUND = 192               # stored per round: 1.5x the pool
BATCH = 32
VERIFY_S = 20.0
RECENT = 4 * PER_ROUND        # the last rounds' keys: fit the disk tier


def _kill(daemon) -> None:
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(timeout=10)


def test_sigkill_mid_demotion_and_mid_promotion_never_serves_a_wrong_block(start_daemon,
                                                                          tmp_path):
    rng = random.Random(20)
    disk = tmp_path / "disk"
    stored: list[bytes] = []
    loaded_total = 0
    for r in range(ROUNDS):
        daemon = start_daemon("--pool-size", POOL, "--extent-size", "4MiB", env=disk_env(disk))
        wait_until(lambda d=daemon: d.stats()["tiers"][0]["health"] == "ok", 20,
                   "the disk tier to open")
        session = open_session(daemon.socket, MODEL, reserve=64)
        try:
            if stored:
                # What earlier daemons wrote: on the disk (HIT_PENDING, then HIT) or lost to
                # a kill (MISS); never wrong bytes.
                sample = rng.sample(stored, min(len(stored), 2 * BATCH))
                loaded, _ = read_back(session, sample, BATCH, VERIFY_S)
                loaded_total += loaded
            fresh = keys_for(f"tier-fault-{r}", PER_ROUND)
            for i in range(0, PER_ROUND, BATCH):
                store(session, fresh[i:i + BATCH])
            stored += fresh
            if r % 2 == 0:
                # Mid-demotion: the evicted blocks are still being written.
                time.sleep(rng.uniform(0, 0.01))
            else:
                # Mid-promotion: ask for the oldest blocks (on the disk) and kill while they
                # are read back into the pool.
                asked = [k for k in stored[:BATCH] if session.lookup(k) is Lookup.HIT_PENDING]
                session.end_step()
                time.sleep(rng.uniform(0, 0.01))
                assert asked or r == 1 or loaded_total
        finally:
            _kill(daemon)
            close_session(session)

    daemon = start_daemon("--pool-size", POOL, "--extent-size", "4MiB", env=disk_env(disk))
    wait_until(lambda: daemon.stats()["tiers"][0]["health"] == "ok", 20, "the disk tier to open")
    session = open_session(daemon.socket, MODEL, reserve=64)
    recent = stored[-RECENT:]             # what the disk (1024 blocks, LRU) still holds
    try:
        loaded, _ = read_back(session, recent, BATCH, VERIFY_S)
        tier = daemon.stats()["tiers"][0]
        assert tier["corrupt_total"] == 0 and tier["failures_total"] == 0
    finally:
        close_session(session)
    # Blocks outlive the kills: only the pool's own blocks (a memfd) and the writes in flight
    # at a kill are lost, about a third of each round.
    assert loaded >= len(recent) // 3, (loaded, len(recent))
    assert loaded_total, "no block written before a kill was found again"
