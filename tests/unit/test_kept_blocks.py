"""Kept blocks on a real KvdCore: a granted slot that came free by an eviction still holds the
evicted block, GRANTED names it to a session that asked (RESERVE flag 2), and RESTORE takes
it back as that block (docs/attach.md, "Kept blocks in granted slots"). What the daemon
accepts here is all that keeps a restored block's bytes its own: a key that does not match
what was named, a slot the session stored into or does not hold, a block a reset dropped, a
key stored again elsewhere are never published."""

from __future__ import annotations

from kvd_server.core.core import KvdCore
from kvd_server.core.sessions import Session
from kvd_server.manager import Lookup
from kvd_server.protocols.fastpath import FastPath
from tests.support.core import make_core, protocols, session

SLOT = 8192
POOL = 256 << 10                  # 32 slots of 8 KiB


def key(i: int) -> bytes:
    return i.to_bytes(2, "big") * 4


def full_pool(kept: bool = True) -> tuple[KvdCore, FastPath, Session, list[bytes]]:
    """A pool whose 32 slots hold blocks 0..27 READY (oldest first) and a session holding
    the other 4 granted, told the kept blocks if `kept`."""
    core, _ = make_core(pool=POOL, extent=64 << 10, **{"manager.policy": "lru"})
    fp = protocols(core).fastpath
    s = session(core)
    fp.set_reserve(s, 4, kept=kept)
    stored: list[bytes] = []
    for i in range(0, 28, 4):
        offsets = fp.top_up(s) if i else fp.top_up_kept(s).offsets
        keys = [key(i + j) for j in range(4)]
        answer = fp.store_granted(s, keys, f"r{i}", None, keys, offsets[:4])
        assert answer.accepted == 4
        done = protocols(core).completions.complete_store(s, keys, True, f"r{i}", answer.epoch)
        assert done.completed == 4
        core.request_finished(s, f"r{i}")
        stored += keys
    fp.top_up(s)
    assert len(s.granted) == 4 and s.ns is not None
    return core, fp, s, stored


def store_into_reserve(core: KvdCore, fp: FastPath, s: Session, keys: list[bytes]) -> None:
    """The session stores `keys` into 4 of its granted slots (evicting for its reserve)."""
    offsets = fp.top_up(s) or [s.ns.slots.offset(slot) for slot in sorted(s.granted)]
    answer = fp.store_granted(s, keys, "new", None, keys, offsets[:len(keys)])
    assert answer.accepted == len(keys)
    protocols(core).completions.complete_store(s, keys, True, "new", answer.epoch)


def test_a_top_up_names_the_blocks_its_slots_still_hold_oldest_evicted_and_restore_publishes_them():
    core, fp, s, stored = full_pool()
    ns = s.ns
    assert ns is not None
    store_into_reserve(core, fp, s, [key(100 + j) for j in range(4)])
    granted = fp.top_up_kept(s)            # the eviction's slots, for the reserve again
    assert len(granted.offsets) == 4
    assert sorted(granted.kept_keys) == stored[:4], "not the least recently used blocks"
    for k in granted.kept_keys:
        assert ns.mgr.lookup(k) is Lookup.MISS          # evicted: no other session sees it
    k = granted.kept_keys[0]
    offset = granted.offsets[granted.kept_index[0]]
    assert fp.restore(s, [k], [offset]) == 1
    assert ns.mgr.lookup(k) is Lookup.HIT
    assert ns.slots.offset(ns.mgr.slot_of(k)) == offset, "not back in the slot that holds it"
    assert ns.slots.slot_at(offset) not in s.granted, "a restored slot stayed in the reserve"
    assert ns.mgr.counters.blocks_restored_total == 1
    # The slot left the reserve: the session is owed one (topped up, evicting for it).
    assert fp.owes(s)


def test_restore_publishes_nothing_the_session_cannot_vouch_for():
    core, fp, s, stored = full_pool()
    ns = s.ns
    assert ns is not None
    store_into_reserve(core, fp, s, [key(100 + j) for j in range(4)])
    granted = fp.top_up_kept(s)
    by_key = {k: granted.offsets[i] for i, k in zip(granted.kept_index, granted.kept_keys,
                                                    strict=True)}
    (k0, o0), (k1, o1), (k2, o2), (k3, o3) = sorted(by_key.items())
    free_before = ns.slots.free_count()
    # Another key than the slot was named with: refused, the slot freed (it left the reserve).
    assert fp.restore(s, [key(999)], [o0]) == 0
    assert ns.mgr.lookup(key(999)) is Lookup.MISS and ns.mgr.lookup(k0) is Lookup.MISS
    assert ns.slots.slot_at(o0) not in s.granted
    assert ns.slots.free_count() == free_before + 1
    # A slot this session does not hold (another's block, a slot never granted): ignored.
    other = ns.slots.offset(ns.mgr.slot_of(stored[10]))
    assert fp.restore(s, [k1], [other]) == 0
    assert ns.mgr.lookup(stored[10]) is Lookup.HIT and ns.mgr.lookup(k1) is Lookup.MISS
    # A slot the session stored into: what it held is gone.
    answer = fp.store_granted(s, [key(200)], "w", None, [key(200)], [o1])
    assert answer.accepted == 1
    assert fp.restore(s, [k1], [o1]) == 0
    assert ns.mgr.lookup(k1) is Lookup.MISS
    # The key stored again elsewhere meanwhile: the index keeps that block; the slot is freed.
    store_into_reserve(core, fp, s, [k2])
    assert ns.mgr.lookup(k2) is Lookup.HIT
    elsewhere = ns.mgr.slot_of(k2)
    assert fp.restore(s, [k2], [o2]) == 0
    assert ns.mgr.slot_of(k2) == elsewhere
    # A reset between: every kept block is gone with the epoch.
    core.reset_namespace(s)
    assert fp.restore(s, [k3], [o3]) == 0
    assert ns.mgr.lookup(k3) is Lookup.MISS
    assert ns.mgr.counters.blocks_restored_total == 0


def test_a_session_that_did_not_ask_is_told_nothing():
    core, fp, s, _ = full_pool(kept=False)
    store_into_reserve(core, fp, s, [key(100 + j) for j in range(4)])
    granted = fp.top_up_kept(s)
    assert len(granted.offsets) == 4 and not granted.kept_keys and not s.kept


def test_kept_blocks_are_forgotten_when_their_extent_leaves_the_namespace():
    """A slot of an extent that went to another namespace may be written there: what it held
    when evicted here is never named again."""
    core, fp, s, _ = full_pool()
    ns = s.ns
    assert ns is not None
    store_into_reserve(core, fp, s, [key(100 + j) for j in range(4)])
    kept = dict(ns.slots.kept)
    assert len(kept) == 4
    extent = next(iter(kept)) // ns.slots.per_extent
    ns.slots._drop_free_of(extent)
    assert all(slot // ns.slots.per_extent != extent for slot in ns.slots.kept)


def test_kvd_keep_evicted_takes_a_boolean_and_names_itself_when_it_is_not_one():
    import pytest

    from kvd_client.vllm.offloading_spec import _flag

    assert _flag(True, "kvd_keep_evicted") is True
    assert _flag("false", "kvd_keep_evicted") is False
    assert _flag("1", "kvd_keep_evicted") is True
    with pytest.raises(ValueError, match="kvd_keep_evicted must be true or false"):
        _flag("sometimes", "kvd_keep_evicted")
