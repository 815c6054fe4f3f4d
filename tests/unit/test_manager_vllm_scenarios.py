"""vLLM 0.33's CPU-manager scenarios, replayed against kvd's NamespaceManager.

Each test mirrors one test of vLLM's tests/v1/kv_offload/cpu/test_manager.py (named in its
docstring), in our own code, asserting the same slot ids, evictions, lookups and events. vLLM's
tests pass one shared request context for un-scoped calls; `ANY` plays that role here.
"""

from __future__ import annotations

import pytest

from kvd_server.manager import FixedSlots, Lookup, NamespaceManager

ANY = "shared-request-context"


def k(i: int, group: int = 0) -> bytes:
    """A vLLM-shaped offload key: hash bytes + 4-byte big-endian group index."""
    return str(i).encode() + group.to_bytes(4, "big")


def ks(ints: list[int]) -> list[bytes]:
    return [k(i) for i in ints]


def mgr(n: int = 4, policy: str = "lru", **kw) -> NamespaceManager:
    return NamespaceManager(FixedSlots(n), policy, **kw)


def stored(m, ints, req=ANY):
    grant = m.prepare_store(ks(ints), req)
    assert grant is not None
    m.complete_store(grant.keys_to_store, True, req)
    return grant


def check_grant(grant, keys, slots, evicted):
    assert grant is not None
    assert grant.keys_to_store == ks(keys)
    assert grant.slots == slots
    assert grant.evicted_keys == ks(evicted)


def event_sets(m):
    events, _ = m.take_events()
    stores = [set(e.keys) for e in events if not e.removed]
    removals = [set(e.keys) for e in events if e.removed]
    return stores, removals


def S(*ints_sets):
    return [set(ks(list(s))) for s in ints_sets]


def test_cpu_manager_lru_scenario():
    """vLLM: test_cpu_manager."""
    m = mgr(4, "lru")
    check_grant(m.prepare_store(ks([1, 2]), ANY), [1, 2], [0, 1], [])
    assert m.lookup(k(1)) is Lookup.HIT_PENDING
    assert m.lookup(k(2)) is Lookup.HIT_PENDING
    assert m.take_events() == ([], False)
    m.complete_store(ks([1, 2]), True, ANY)
    assert event_sets(m) == (S({1, 2}), [])
    assert m.lookup(k(1)) is Lookup.HIT
    assert m.lookup(k(3)) is Lookup.MISS

    check_grant(m.prepare_store(ks([2, 3, 4, 5]), ANY), [3, 4, 5], [2, 3, 0], [1])
    assert event_sets(m) == ([], S({1}))
    assert m.prepare_store(ks([1, 6]), ANY) is None
    m.complete_store(ks([2, 3, 4, 5]), True, ANY)
    assert [m.lookup(k(i)) for i in (1, 2, 3, 4, 5, 0)] == [
        Lookup.MISS, Lookup.HIT, Lookup.HIT, Lookup.HIT, Lookup.HIT, Lookup.MISS]

    assert m.prepare_load(ks([2, 3]), "load-2-3") == [1, 2]
    assert m.prepare_store(ks([6, 7, 8]), ANY) is None
    m.complete_load(ks([2, 3]), "load-2-3")
    m.request_finished("load-2-3")
    # Oldest first; within the accessed prefix [2, 3] the tail goes before the head.
    check_grant(m.prepare_store(ks([6, 7, 8]), ANY), [6, 7, 8], [2, 0, 3], [4, 5, 3])
    m.complete_store(ks([6, 7, 8]), True, ANY)
    m.touch(ks([2, 6, 7]), ANY)
    check_grant(m.prepare_store(ks([9]), ANY), [9], [3], [8])
    m.complete_store(ks([7, 9]), False, ANY)
    assert m.lookup(k(7)) is Lookup.HIT
    assert m.lookup(k(9)) is Lookup.MISS
    assert event_sets(m) == (S({3, 4, 5}, {6, 7, 8}), S({4, 5, 3}, {8}, {9}))


def test_eviction_removed_event_precedes_stored():
    """vLLM: test_cpu_eviction_removed_precedes_stored."""
    m = mgr(2)
    stored(m, [1, 2])
    m.take_events()
    stored(m, [3])
    events, more = m.take_events()
    assert not more
    removed = [i for i, e in enumerate(events) if e.removed]
    added = [i for i, e in enumerate(events) if not e.removed]
    assert removed and added and max(removed) < min(added)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_already_stored_chunk_not_evicted_during_prepare_store(policy):
    """vLLM: test_already_stored_chunk_not_evicted_during_prepare_store."""
    m = mgr(2, policy)
    stored(m, [1, 2])
    # Offer [1, 3]: 1 is present and offered, so only 2 may be evicted for 3.
    check_grant(m.prepare_store(ks([1, 3]), ANY), [3], [1], [2])
    m.complete_store(ks([3]), True, ANY)
    assert m.lookup(k(1)) is Lookup.HIT
    assert m.lookup(k(2)) is Lookup.MISS


def test_prepare_load_preserves_key_order():
    """vLLM: test_prepare_load_preserves_key_order."""
    m = mgr(4)
    stored(m, [1, 2, 3])
    assert m.prepare_load(ks([3, 1, 2]), "r") == [2, 0, 1]


def test_lru_batch_eviction_failure_is_atomic():
    """vLLM: test_lru_batch_eviction_failure_is_atomic."""
    m = mgr(3)
    stored(m, [1, 2, 3])
    m.prepare_load(ks([2]), "pin")
    # Needs 3 victims, only 1 and 3 are evictable (2 is pinned): nothing may change.
    assert m.prepare_store(ks([4, 5, 6]), ANY) is None
    assert [m.lookup(k(i)) for i in (1, 2, 3)] == [Lookup.HIT] * 3
    check_grant(m.prepare_store(ks([4, 5]), ANY), [4, 5], [2, 0], [1, 3])


def test_lru_repeated_pin_cycles_keep_heap_bounded():
    """vLLM: test_lru_repeated_pin_cycles_compact_lazy_heap_entries (kvd's heap is only the
    eviction front: every pin cycle pushes a fresh entry, compaction bounds them)."""
    m = mgr(4)
    m.policy.front_size = 2
    stored(m, [1, 2, 3, 4])
    m.policy._refill(4)                   # a front holding every evictable block
    for _ in range(1000):
        m.prepare_load(ks([1]), "r")
        m.complete_load(ks([1]), "r")
    assert len(m.policy._front) <= 4 * 2
    check_grant(m.prepare_store(ks([5]), ANY), [5], [0], [1])   # the order survived


def test_take_events_prunes_retried_cleanup_and_drains_once():
    """vLLM: test_take_events_prunes_retried_cleanup_and_drains_once."""
    m = mgr(4)
    m.prepare_store(ks([1, 2]), ANY)
    m.complete_store(ks([1, 2]), False, ANY)
    m.prepare_store(ks([1]), ANY)          # a retry owns key 1 again
    events, _ = m.take_events()
    assert [(set(e.keys), e.removed, e.metadata_only) for e in events] == [
        ({k(2)}, True, True)]
    assert m.take_events() == ([], False)


def test_request_finish_orders_lru_prefix_independent_of_store_completion():
    """vLLM: test_request_finish_orders_lru_prefix_independent_of_store_completion."""
    m = mgr(3)
    m.prepare_store(ks([1, 2, 3]), "r", positions=[16, 32, 48])
    m.complete_store(ks([3]), True, "r")   # completion order: tail first
    m.complete_store(ks([1, 2]), True, "r")
    m.request_finished("r")
    # Head most recent: the tail (3) goes first, then 2.
    check_grant(m.prepare_store(ks([4, 5]), ANY), [4, 5], [1, 2], [3, 2])


def test_unfinished_lru_request_tail_is_evicted_before_its_head():
    """vLLM: test_unfinished_lru_prefix_survives_pressure_across_store_batches (shape)."""
    m = mgr(4)
    m.prepare_store(ks([1, 2]), "r", positions=[16, 32])
    m.complete_store(ks([1, 2]), True, "r")
    m.prepare_store(ks([3, 4]), "r", positions=[48, 64])
    m.complete_store(ks([3, 4]), True, "r")
    grant = m.prepare_store(ks([9]), ANY)
    assert grant.evicted_keys == ks([4])


# --------------------------------------------------------------------------------- ARC
def test_arc_basic_and_promotion():
    """vLLM: TestARCPolicy.test_basic / test_t1_to_t2_promotion."""
    m = mgr(4, "arc")
    stored(m, [1, 2])
    pol = m.policy
    assert list(pol.t1) == ks([1, 2]) and not pol.t2
    m.prepare_load(ks([1]), "r")
    m.complete_load(ks([1]), "r")
    m.request_finished("r")
    assert list(pol.t1) == ks([2]) and list(pol.t2) == ks([1])


def test_arc_eviction_with_load():
    """vLLM: TestARCPolicy.test_eviction_with_load."""
    m = mgr(4, "arc")
    stored(m, [1, 2, 3, 4])
    m.prepare_load(ks([1]), "r")      # pinned: not evictable
    check_grant(m.prepare_store(ks([5]), ANY), [5], [1], [2])
    assert k(2) in m.policy.b1
    m.complete_load(ks([1]), "r")


def test_arc_adaptive_target_on_ghost_hit():
    """vLLM: TestARCPolicy.test_adaptive_target."""
    m = mgr(2, "arc")
    stored(m, [1, 2])
    stored(m, [3])                    # evicts 1 into B1
    assert k(1) in m.policy.b1
    before = m.policy.target_t1_size
    m.prepare_store(ks([1]), "fresh-request")   # a store miss on a B1 ghost
    assert m.policy.target_t1_size > before


def test_arc_pending_chunk_is_not_a_frequency_hit():
    """vLLM: test_arc_pending_chunk_is_not_a_frequency_hit."""
    m = mgr(4, "arc")
    m.prepare_store(ks([1]), "r")
    m.touch(ks([1]), "r")
    assert list(m.policy.t1) == ks([1]) and not m.policy.t2


def test_arc_counts_reuse_once_and_keeps_insertions_in_t1():
    """vLLM: test_arc_counts_reuse_once_and_keeps_insertions_in_t1."""
    m = mgr(4, "arc")
    stored(m, [1], req="a")
    m.request_finished("a")
    assert list(m.policy.t1) == ks([1])
    m.prepare_store(ks([1, 2]), "b")      # 1 is reused (ready), 2 inserted
    m.complete_store(ks([2]), True, "b")
    m.request_finished("b")
    assert list(m.policy.t2) == ks([1])
    assert list(m.policy.t1) == ks([2])


def test_arc_ghost_lists_bounded():
    """vLLM: TestARCPolicy.test_ghost_list_bounds."""
    m = mgr(2, "arc")
    for i in range(20):
        stored(m, [i])
    assert len(m.policy.b1) <= 2 and len(m.policy.b2) <= 2
