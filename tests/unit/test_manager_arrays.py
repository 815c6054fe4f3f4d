"""The array-backed index: eviction order does not depend on how deep the LRU front is or on
rank renumbering, keys the shared index cannot hold still work, and resident blocks cost no
Python objects."""

from __future__ import annotations

import gc
import random

import pytest

from kvd_server.manager import FixedSlots, Lookup, NamespaceManager

CAPACITY = 24


def key(i: int, group: int = 0) -> bytes:
    return i.to_bytes(8, "big") + group.to_bytes(4, "big")


def drive(managers: list[NamespaceManager], seed: int, steps: int = 1200) -> int:
    """The same random workload through every manager; every answer must agree. Returns how
    many blocks were evicted (so a run that never evicts proves nothing)."""
    rng = random.Random(seed)
    storing: dict[bytes, str] = {}          # key -> request that stores it
    loading: list[tuple[str, list[bytes]]] = []
    open_reqs: list[str] = []
    evicted = 0
    for step in range(steps):
        op = rng.random()
        if op < 0.45:
            if len(open_reqs) >= 16 or (open_reqs and rng.random() < 0.7):
                req = rng.choice(open_reqs)
            else:
                req = f"q{step}"
            if req not in open_reqs:
                open_reqs.append(req)
            start = rng.randrange(60)
            groups = rng.choice((1, 1, 2))   # hybrid: two groups share each position's rank
            keys = [key(start + i, g) for i in range(rng.randint(1, 6)) for g in range(groups)]
            positions = [16 * (k[7] % 64) for k in keys] if rng.random() < 0.8 else None
            grants = [m.prepare_store(keys, req, positions) for m in managers]
            assert all(g == grants[0] for g in grants), (step, grants)
            if grants[0] is not None:
                evicted += len(grants[0].evicted_keys)
                for k in grants[0].keys_to_store:
                    storing[k] = req
        elif op < 0.65 and storing:
            done = rng.sample(sorted(storing), rng.randint(1, min(4, len(storing))))
            ok = rng.random() < 0.9
            for m in managers:
                m.complete_store(done, ok)
            for k in done:
                del storing[k]
        elif op < 0.8:
            req = rng.choice(open_reqs) if open_reqs else f"q{step}"
            candidates = [key(i, g) for i in range(60) for g in range(2)]
            ready = [k for k in candidates if managers[0].lookup(k) == Lookup.HIT]
            if ready:
                keys = rng.sample(ready, min(len(ready), rng.randint(1, 3)))
                slots = [m.prepare_load(keys, req) for m in managers]
                assert all(s == slots[0] for s in slots)
                loading.append((req, keys))
        elif op < 0.9 and loading:
            req, keys = loading.pop(rng.randrange(len(loading)))
            for m in managers:
                m.complete_load(keys, req)
        elif op < 0.97 and open_reqs:
            req = open_reqs.pop(rng.randrange(len(open_reqs)))
            for m in managers:
                m.request_finished(req)
        else:
            keys = [key(rng.randrange(60)) for _ in range(3)]
            for m in managers:
                m.touch(keys, rng.choice(open_reqs) if open_reqs else None)
        lookups = [[m.lookup(key(i, g)) for i in range(60) for g in range(2)] for m in managers]
        assert all(x == lookups[0] for x in lookups), step
        assert all(m.counts() == managers[0].counts() for m in managers), step
    return evicted


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("front", "max_order"), [(1, None), (3, None), (None, 80),
                                                   (2, 60)])
def test_lru_front_depth_and_renumbering_keep_the_eviction_order(seed, front, max_order):
    """A shallow front refills often and renumbering rewrites every rank: neither may change
    a single victim, slot or lookup against the deep-front manager (which, at this size,
    holds every evictable block in its heap exactly as vLLM does)."""
    reference = NamespaceManager(FixedSlots(CAPACITY), "lru")
    variant = NamespaceManager(FixedSlots(CAPACITY), "lru")
    if front is not None:
        variant.policy.front_size = front
    if max_order is not None:
        variant.policy.max_order = max_order
    assert drive([reference, variant], seed) > 50
    assert (variant.policy.renumbered > 0) == (max_order is not None)


def test_renumbering_keeps_open_requests_ranked_with_their_blocks():
    m = NamespaceManager(FixedSlots(4), "lru")
    m.policy.max_order = 8
    for i in range(4):
        m.prepare_store([key(i)], f"r{i}", [0])
        m.complete_store([key(i)], True)
    for _ in range(5):                        # ranks run out and are renumbered
        m.touch([key(3)], None)
    assert m.policy.renumbered and m.policy._next_rank <= 8
    grant = m.prepare_store([key(9)], "r0", [0])   # r0's rank is still the oldest
    assert grant is not None and grant.evicted_keys == [key(0)]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_keys_longer_than_the_index_width_are_still_managed(policy):
    """The shared index holds keys up to its width; a longer key (allowed over gRPC) lives in
    the manager's spill table: stored, found, loaded, evicted and reset like any other."""
    m = NamespaceManager(FixedSlots(2), policy)
    long_keys = [bytes([i]) * 100 for i in range(3)]
    for k in long_keys[:2]:
        grant = m.prepare_store([k], "r")
        assert grant is not None and grant.keys_to_store == [k]
        m.complete_store([k], True)
    assert m.lookup(long_keys[0]) == Lookup.HIT
    assert m.index.find(long_keys[0]) == -1          # engines never see it
    assert m.prepare_load([long_keys[1]], "r") == [1]
    m.complete_load([long_keys[1]], "r")
    m.request_finished("r")
    grant = m.prepare_store([long_keys[2]], "s")
    assert grant is not None and len(grant.evicted_keys) == 1
    assert m.lookup(grant.evicted_keys[0]) == Lookup.MISS
    m.complete_store([long_keys[2]], True)
    assert m.reset() == 2 and m.is_empty()
    assert all(m.lookup(k) == Lookup.MISS for k in long_keys)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_resident_blocks_cost_no_python_objects(policy):
    """What the index holds per block lives in arrays: storing 20,000 blocks (with evictions)
    leaves the garbage collector with nothing new to walk."""
    m = NamespaceManager(FixedSlots(20_000), policy, enable_events=False)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(0, 30_000, 100):
        keys = [key(j) for j in range(i, i + 100)]
        grant = m.prepare_store(keys, None)
        assert grant is not None
        m.complete_store(grant.keys_to_store, True)
    assert len(m) == 20_000
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert grown < 500, f"{grown} new objects for 20,000 resident blocks"


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_duplicate_store_completing_first_keeps_the_blocks_place_in_the_order(policy):
    """Two engines store the same key into their own granted slots; the later grant completes
    first, so the block moves to its slot: it must keep its rank / list position there, and
    the losing slot must come back."""
    slots = FixedSlots(4)
    m = NamespaceManager(slots, policy)
    a, b = slots.allocate(2)                      # two engines' reserves: slots 0 and 1
    assert m.offer([key(1)], [(key(1), a)], "r1").accepted == [key(1)]
    assert m.offer([key(1)], [(key(1), b)], "r2").duplicates == [key(1)]
    grant = m.prepare_store([key(2), key(3)], "r3")
    assert grant is not None and grant.slots == [2, 3]
    m.complete_store([key(2), key(3)], True)
    m.complete_store([key(1)], True, slots=[b])   # the duplicate wins the race
    assert m.slot_of(key(1)) == b and m.lookup(key(1)) == Lookup.HIT
    assert m.index.find(key(1)) == b
    m.complete_store([key(1)], True, slots=[a])   # the first grant's copy loses its slot
    assert slots.free_count() == 1
    grant = m.prepare_store([key(4)], "r4")
    assert grant is not None and grant.slots == [a] and grant.evicted_keys == []
    m.complete_store([key(4)], True)
    grant = m.prepare_store([key(5)], "r5")       # key 1 is the oldest, wherever it lives
    assert grant is not None and grant.evicted_keys == [key(1)] and grant.slots == [b]
    assert m.lookup(key(1)) == Lookup.MISS and m.counts().resident == 4
