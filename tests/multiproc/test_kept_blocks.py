"""Kept blocks between real processes: an engine whose stores evict keeps hitting the blocks
evicted into the slots its reserve holds, as vLLM's own manager (which evicts only when a store
needs the room) would, and loads them byte for byte; no other engine sees them; a reset ends
them (docs/attach.md, "Kept blocks in granted slots").

Without them an engine's reserve (slots the daemon evicted for ahead of its stores) is pool
capacity its hits lose: at equal pool bytes about 1% of vLLM's hit tokens under load
(bench/control_plane.py at 3,000 sessions).
"""

from __future__ import annotations

import pytest

from kvd_client.offload.session import Lookup
from tests.support.engine import keys_for
from tests.support.offload_engine import (
    EngineProcess,
    assert_no_slot_leaked,
    close_session,
    namespace,
    open_session,
    read_back,
    settle,
    store,
)

pytestmark = pytest.mark.multiproc
MODEL = "kept-blocks-model"
SMALL_POOL = ("--pool-size", "8MiB", "--extent-size", "2MiB")     # 128 slots of 64 KiB
RESERVE = 32


def churn(session, seed: str, n: int) -> list[bytes]:
    """Store `n` new keys in batches of 16 (evicting all along once the pool is full)."""
    keys = keys_for(seed, n)
    for i in range(0, n, 16):
        assert store(session, keys[i:i + 16]) is not None
    settle(session)
    return keys


def test_blocks_evicted_into_an_engines_reserve_are_still_its_hits_and_load_byte_for_byte(
        start_daemon):
    daemon = start_daemon(*SMALL_POOL)
    a = open_session(daemon.socket, MODEL, reserve=RESERVE)
    other: EngineProcess | None = None
    try:
        keys = churn(a, "kept", 4 * 128)
        in_index = namespace(daemon.stats(), MODEL)["blocks"]["ready"]
        # Another engine sees only what the index holds: the kept blocks are this one's.
        other = EngineProcess(daemon.socket, MODEL)
        seen = other.ask("lookup", keys)["states"]
        other.ask("end_step")
        assert seen.count("hit") == in_index and seen.count("hit_pending") == 0, \
            (seen.count("hit"), in_index)
        # This engine loads every block the index holds, and the kept ones besides (each
        # HIT_PENDING for a step, then a HIT whose bytes are its own: read_back checks).
        loaded, missed = read_back(a, keys)
        restored = namespace(daemon.stats(), MODEL)["blocks_restored_total"]
        assert loaded == in_index + restored, (loaded, in_index, restored)
        assert restored > 0, "no block evicted into this engine's reserve was still a hit"
        assert loaded + missed == len(keys)
    finally:
        if other is not None:
            other.close()
        close_session(a)
    assert_no_slot_leaked(daemon, MODEL)


def test_a_reset_ends_the_kept_blocks(start_daemon):
    daemon = start_daemon(*SMALL_POOL)
    a = open_session(daemon.socket, MODEL, reserve=RESERVE)
    try:
        keys = churn(a, "kept-reset", 3 * 128)
        a.reset()
        settle(a)
        assert [a.lookup(k) for k in keys].count(Lookup.HIT) == 0
        a.end_step()
        loaded, missed = read_back(a, keys)
        assert (loaded, missed) == (0, len(keys))
        assert namespace(daemon.stats(), MODEL)["blocks_restored_total"] == 0
    finally:
        close_session(a)
    assert_no_slot_leaked(daemon, MODEL)
