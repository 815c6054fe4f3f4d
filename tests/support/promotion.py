"""Reading back blocks a tier below the pool holds (the disk tier, the cluster tier), as a
scheduler does: look them up step after step until every one is a HIT (HIT_PENDING while
its promotion runs, never a MISS), then load them and check their bytes. For the promotion
and cluster-tier tests, which read back what the pool evicted."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvd_client.offload.session import Lookup, OffloadSession
from tests.support.engine import block_bytes_of
from tests.support.offload_engine import read_block, settle

STEPS = 2000                  # a bound on the steps one batch may wait for its promotions


def until_hit(session: OffloadSession, keys: Sequence[bytes], after: str = ""
              ) -> dict[bytes, Lookup]:
    """Look `keys` up step after step as a scheduler does until every one is a HIT (none
    ever a MISS); the first answer of each key."""
    first: dict[bytes, Lookup] = {}
    for _ in range(STEPS):
        states = [session.lookup(k) for k in keys]
        for k, s in zip(keys, states, strict=True):
            first.setdefault(k, s)
        assert Lookup.MISS not in states, \
            f"{states.count(Lookup.MISS)} keys held on disk read MISS{after}"
        if all(s is Lookup.HIT for s in states):
            return first
        session.end_step()
        time.sleep(0.002)
    raise AssertionError(f"promotions did not finish in {STEPS} steps")


def read_back_promoted(session: OffloadSession, keys: Sequence[bytes]) -> tuple[dict, list[bytes]]:
    """`until_hit`, then load them: (the first answer of each key, the keys whose bytes were
    wrong). (tests/support/offload_engine.py's `read_back` reads in batches and counts MISSes
    instead.)"""
    first = until_hit(session, keys)
    offsets = session.start_loads(keys)
    pool = session.client.pool
    bad = [k for k, o in zip(keys, offsets, strict=True)
           if o is None or read_block(pool, o) != block_bytes_of(k)]
    session.finish_loads(keys)
    settle(session)
    return first, bad
