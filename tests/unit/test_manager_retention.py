"""Retention in the manager (manager/retention.py): retained blocks are evicted only when no
other victim is left, under LRU and ARC alike; hints expire, sessions release, resets drop."""

from __future__ import annotations

import random

import pytest

from kvd_server.manager import FixedSlots, Lookup, NamespaceManager


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def store(m: NamespaceManager, keys: list[bytes], req: str = "r") -> list[bytes]:
    grant = m.prepare_store(keys, req)
    assert grant is not None
    m.complete_store(grant.keys_to_store, True)
    m.request_finished(req)
    return grant.evicted_keys


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_retained_blocks_survive_a_flood_until_nothing_else_is_left(policy):
    m = NamespaceManager(FixedSlots(16), policy)
    store(m, [key(i) for i in range(4)], "agent")
    assert m.retain([key(i) for i in range(4)], "s-1", until=100.0, room=16) == (4, 0)
    for i in range(100, 300):                   # far more than the pool holds
        store(m, [key(i)], f"r{i}")
        for j in range(4):
            assert m.lookup(key(j)) == Lookup.HIT
    assert m.counts().retained == 4 and m.retention.counters.gave_way_total == 0
    # Only retained blocks left to evict: the one expiring first gives way.
    m.retain([key(0)], "s-1", until=50.0, room=16)      # takes the later expiry: 100
    m.retain([key(300 - k) for k in range(1, 13)], "s-2", until=10.0, room=16)
    assert m.counts().retained == 16 and m.counts().ready == 0
    evicted = store(m, [key(1000)], "late")
    assert len(evicted) == 1 and evicted[0] in {key(300 - k) for k in range(1, 13)}
    assert m.retention.counters.gave_way_total == 1
    assert all(m.lookup(key(j)) == Lookup.HIT for j in range(4))


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_room_cuts_a_hint_and_expiry_and_release_let_blocks_go(policy):
    m = NamespaceManager(FixedSlots(8), policy)
    store(m, [key(i) for i in range(6)])
    assert m.retain([key(i) for i in range(6)], "s", until=10.0, room=4) == (4, 2)
    assert m.retention.counters.cut_total == 2 and m.counts().retained == 4
    assert m.expire(5.0) == 0
    assert m.expire(10.0) == 4 and m.counts().retained == 0 and m.counts().ready == 6
    m.retain([key(0), key(1)], "s", until=20.0, room=8)
    m.retain([key(2)], "t", until=20.0, room=8)
    assert sorted(v.tag for v in m.retention.tags()) == ["s", "t"]
    assert m.release_tag("s") == 2 and m.release_tag("nobody") == 0
    assert [v.tag for v in m.retention.tags()] == ["t"]
    assert m.counts().ready == 5 and m.counts().retained == 1


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_pinned_retained_block_stays_pinned_when_let_go_and_resets_drop_retention(policy):
    m = NamespaceManager(FixedSlots(4), policy)
    store(m, [key(0), key(1)])
    m.retain([key(0), key(1)], "s", until=10.0, room=4)
    m.prepare_load([key(0)], "load")
    assert m.release_tag("s") == 2
    c = m.counts()
    assert (c.ready, c.pinned, c.retained) == (1, 1, 0)
    m.complete_load([key(0)], "load")
    m.retain([key(0)], "s", until=10.0, room=4)
    assert m.reset() == 2
    assert len(m.retention) == 0 and m.counts().zombie == 0
    assert len(store(m, [key(i) for i in range(10, 14)])) == 0   # every slot came back


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_random_operations_keep_the_counts_true(policy):
    rng = random.Random(7)
    m = NamespaceManager(FixedSlots(32), policy)
    now = 0.0
    for step in range(3000):
        now += 0.1
        op = rng.random()
        keys = [key(rng.randrange(80)) for _ in range(rng.randrange(1, 5))]
        keys = list(dict.fromkeys(keys))
        if op < 0.5:
            grant = m.prepare_store(keys, f"r{step}")
            if grant is not None:
                m.complete_store(grant.keys_to_store, rng.random() < 0.9)
            m.request_finished(f"r{step}")
        elif op < 0.75:
            m.retain(keys, rng.choice("abc"), now + rng.uniform(0, 5), rng.randrange(4))
        elif op < 0.85:
            m.expire(now)
        elif op < 0.95:
            m.release_tag(rng.choice("abc"))
        elif op < 0.99:
            ready = [k for k in keys if m.lookup(k) == Lookup.HIT]
            if ready:
                m.prepare_load(ready, "l")
                m.complete_load(ready, "l")
        else:
            m.reset()
        c = m.counts()
        states = m.table.state_array
        assert c.resident == len(m.table)
        assert c.ready == int((states == 2).sum())
        assert c.retained == len(m.retention) <= len(m.table)
        for slot in m.retention.until:
            assert states[slot] >= 3
        if policy == "arc":     # a retained block is out of T1/T2, every other one in them
            linked = set(m.policy._slots(1)) | set(m.policy._slots(2))
            assert linked == set(int(s) for s in states.nonzero()[0]) - set(m.retention.until)
