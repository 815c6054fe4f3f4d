"""FastPath on a real KvdCore: the shared-index protocol's grants, StoreGranted and Pin, and the
eviction its stores cause (`NamespaceManager.offer`), as kvd.proto and docs/internals.md state
them. An engine on this path decides alone and tells the daemon afterwards, so what the daemon
accepts, refuses and evicts here is all that keeps one engine's slots from another's."""

from __future__ import annotations

from collections.abc import Sequence

from kvd_proto.wire import MAX_GRANTED_SLOTS
from kvd_proto.wire import KvLayout as Layout
from kvd_server.config import load_config
from kvd_server.core.core import KvdCore
from kvd_server.core.peer import PeerCred
from kvd_server.core.sessions import EngineInfo, Session
from kvd_server.manager import Lookup
from kvd_server.memory.extents import ExtentAllocator
from kvd_server.protocols import fastpath as fastpath_module
from kvd_server.protocols.fastpath import StoreGrantedAnswer
from tests.support.core import protocols

LAYOUT = Layout(block_bytes=8192, num_ranks=2, shard_bytes=4096, tokens_per_block=16,
                dtype="bf16")
SLOT = 8192
POOL = 256 << 10               # 32 slots in 4 extents of 8
EXTENT = 64 << 10


def make_core(pool: int = POOL, extent: int = EXTENT) -> KvdCore:
    ov = {"pool.size": (str(pool), "test"), "pool.extent_size": (str(extent), "test"),
          "manager.liveness_timeout": ("5s", "test"), "manager.policy": ("lru", "test")}
    cfg = load_config(None, env={}, overrides=ov)
    core = KvdCore(cfg, ExtentAllocator(cfg.pool.size, cfg.pool.extent_size),
                   clock=lambda: 1000.0, alive=lambda pid: False)
    core.set_serving()
    return core


def session(core: KvdCore, model: str = "m") -> Session:
    s = core.attach(PeerCred(pid=1, uid=1000, gid=1000))
    assert s is not None
    core.register(s, EngineInfo(engine_id="e"), model, LAYOUT, "")
    return s


def two_sessions(**pool: int) -> tuple[KvdCore, Session, Session]:
    """A core with two sessions of one namespace."""
    core = make_core(**pool)
    a, b = session(core), session(core)
    assert a.ns is b.ns
    return core, a, b


def key(i: int) -> bytes:
    return bytes([i]) * 8


def complete(core: KvdCore, s: Session, keys: Sequence[bytes], req_id: str, epoch: int) -> int:
    """The session's stores of `keys` completed successfully: how many became readable."""
    return protocols(core).completions.complete_store(s, keys, True, req_id, epoch).completed


def store(core: KvdCore, s: Session, keys: list[bytes], offsets: Sequence[int],
          req_id: str) -> StoreGrantedAnswer:
    """One request of the engine: `keys` stored into granted `offsets`, completed, finished."""
    answer = protocols(core).fastpath.store_granted(s, keys, req_id, None, keys, offsets)
    assert answer.accepted == len(keys), answer
    assert complete(core, s, keys, req_id, answer.epoch) == len(keys)
    core.request_finished(s, req_id)
    return answer


def offset_of(s: Session, k: bytes) -> int:
    assert s.ns is not None
    slot = s.ns.mgr.slot_of(k)
    assert slot is not None, k
    return s.ns.slots.offset(slot)


# --- grants -----------------------------------------------------------------------------------


def test_grants_are_free_distinct_slots_bounded_by_what_is_free():
    core, a, b = two_sessions()
    fp, ns = protocols(core).fastpath, a.ns
    assert ns is b.ns
    mine, theirs = fp.grant(a, 3), fp.grant(b, 3)
    assert len(mine) == len(theirs) == 3
    assert len(set(mine) | set(theirs)) == 6, "a slot was granted twice"
    for offsets, s in ((mine, a), (theirs, b)):
        assert all(o % SLOT == 0 and 0 <= o < POOL for o in offsets), offsets
        assert {ns.slots.slot_at(o) for o in offsets} == s.granted
    assert (a.reserve_target, b.reserve_target, ns.reserve_targets, ns.reserve_owed) == \
        (3, 3, 6, 0)
    # Asked for more than is free: what is free (the rest of the pool), the target kept.
    rest = fp.grant(a, 100)
    assert len(rest) == POOL // SLOT - 6
    assert len(set(mine) | set(theirs) | set(rest)) == POOL // SLOT
    assert (a.reserve_target, ns.reserve_owed) == (103, 100 - len(rest))
    # Nothing free: nothing granted; the session is owed it.
    assert fp.grant(b, 1) == []
    assert fp.owes(b) and ns.reserve_owed == 100 - len(rest) + 1


def test_a_session_never_holds_more_than_max_granted_slots():
    core = make_core(pool=64 << 20, extent=4 << 20)       # 8192 slots
    a = session(core)
    offsets = protocols(core).fastpath.grant(a, MAX_GRANTED_SLOTS + 904)
    assert len(offsets) == len(set(offsets)) == MAX_GRANTED_SLOTS
    assert a.reserve_target == MAX_GRANTED_SLOTS
    assert protocols(core).fastpath.grant(a, 1) == []
    assert len(a.granted) == MAX_GRANTED_SLOTS


def test_a_draining_daemon_grants_nothing():
    core = make_core()
    a = session(core)
    assert core.start_drain()
    assert protocols(core).fastpath.grant(a, 4) == [] and not a.granted


# --- StoreGranted -----------------------------------------------------------------------------


def test_store_granted_binds_new_keys_into_the_sessions_own_granted_slots():
    core = make_core()
    fp = protocols(core).fastpath
    a = session(core)
    ns = a.ns
    offsets = fp.grant(a, 3)
    answer = fp.store_granted(a, [key(1), key(2), key(3)], "r", None, [key(1), key(2)],
                              offsets[:2])
    assert (answer.accepted, answer.duplicates, answer.refused, answer.evicted) == (2, 0, 0, [])
    assert [ns.mgr.lookup(k) for k in (key(1), key(2), key(3))] == \
        [Lookup.HIT_PENDING, Lookup.HIT_PENDING, Lookup.MISS]
    # Bound slots are the stores' now, no longer the reserve's.
    assert a.granted == {ns.slots.slot_at(offsets[2])}
    assert a.pending == {(answer.epoch, key(1)): ns.slots.slot_at(offsets[0]),
                         (answer.epoch, key(2)): ns.slots.slot_at(offsets[1])}
    assert complete(core, a, [key(1), key(2)], "r", answer.epoch) == 2
    assert [offset_of(a, k) for k in (key(1), key(2))] == offsets[:2]
    assert ns.mgr.lookup(key(1)) == Lookup.HIT and not a.pending


def test_a_key_another_session_stores_is_a_duplicate_whose_slot_settles_at_completion():
    core, a, b = two_sessions()
    fp, ns = protocols(core).fastpath, a.ns
    mine, theirs = fp.grant(a, 1), fp.grant(b, 1)
    first = fp.store_granted(a, [key(1)], "r", None, [key(1)], mine)
    dup = fp.store_granted(b, [key(1)], "r", None, [key(1)], theirs)
    assert (first.accepted, first.duplicates) == (1, 0)
    assert (dup.accepted, dup.duplicates, dup.refused) == (0, 1, 0)
    assert not b.granted and b.pending, "the duplicate's slot stays the engine's store"
    assert complete(core, a, [key(1)], "r", first.epoch) == 1
    free = ns.slots.free_count()
    complete(core, b, [key(1)], "r", dup.epoch)          # the later copy loses its slot
    assert ns.slots.free_count() == free + 1 and not b.pending
    assert offset_of(a, key(1)) == mine[0] and ns.mgr.lookup(key(1)) == Lookup.HIT


def test_store_granted_refuses_what_is_not_the_sessions_to_bind_and_applies_none_of_it():
    core, a, b = two_sessions()
    fp, ns = protocols(core).fastpath, a.ns
    mine, theirs = fp.grant(a, 4), fp.grant(b, 1)

    def refused(keys: list[bytes], granted: list[bytes], offsets: list[int]) -> int:
        answer = fp.store_granted(a, keys, "r", None, granted, offsets)
        assert answer.accepted + answer.duplicates + answer.refused == len(granted), answer
        return answer.refused

    assert refused([key(1)], [key(1)], theirs) == 1              # another session's slot
    assert refused([key(1)], [key(1)], [1]) == 1                 # no slot at all
    assert refused([key(1)], [key(1)], [POOL]) == 1              # past the pool
    assert refused([key(1)], [key(2)], mine[:1]) == 1            # a key it did not offer
    assert ns.slots.slot_at(theirs[0]) in b.granted
    assert len(a.granted) == 4 and not a.pending
    assert ns.mgr.lookup(key(1)) == ns.mgr.lookup(key(2)) == Lookup.MISS
    # One slot named for two keys holds the first; a key already being stored by this session
    # is not bound a second time.
    assert refused([key(1), key(2)], [key(1), key(2)], [mine[0], mine[0]]) == 1
    assert refused([key(1)], [key(1)], mine[1:2]) == 1
    assert ns.mgr.lookup(key(1)) == Lookup.HIT_PENDING and ns.mgr.lookup(key(2)) == Lookup.MISS
    assert a.granted == {ns.slots.slot_at(o) for o in mine[1:]}


def test_store_granted_past_the_pending_bound_refuses_the_whole_call(monkeypatch):
    monkeypatch.setattr(fastpath_module, "MAX_PENDING_STORES_PER_SESSION", 2)
    core = make_core()
    fp = protocols(core).fastpath
    a = session(core)
    offsets = fp.grant(a, 4)
    assert fp.store_granted(a, [key(1), key(2)], "r", None, [key(1), key(2)],
                            offsets[:2]).accepted == 2
    answer = fp.store_granted(a, [key(3)], "r", None, [key(3)], offsets[2:3])
    assert (answer.accepted, answer.duplicates, answer.refused) == (0, 0, 1)
    assert a.ns.mgr.lookup(key(3)) == Lookup.MISS and len(a.granted) == 2


# --- Pin --------------------------------------------------------------------------------------


def test_pin_loads_pins_only_readable_blocks_where_the_engine_read_them_in_its_namespace():
    core = make_core()
    fp = protocols(core).fastpath
    a, b, other = session(core), session(core), session(core, model="m2")
    ns = a.ns
    offsets = fp.grant(a, 4)
    fp.grant(other, 1)                                   # its namespace has slots of its own
    answer = store(core, a, [key(1), key(2)], offsets[:2], "w")
    fp.store_granted(a, [key(3)], "s", None, [key(3)], offsets[2:3])     # still being stored
    o1, o2, o3 = offsets[:3]
    pinned, epoch = fp.pin_loads(b, [key(1), key(2), key(3), key(4), key(2)],
                                 [o1, o1, o3, offsets[3], 7], "", None)
    # key 2 read at key 1's slot, key 3 not readable yet, key 4 absent, an offset no slot has
    assert (pinned, epoch) == (1, answer.epoch)
    assert b.pins == {(epoch, key(1)): 1}
    assert ns.mgr.counts().pinned == 1
    # Another namespace's session cannot pin blocks of this one, whatever offsets it names.
    assert fp.pin_loads(other, [key(1), key(2)], [o1, o2], "", None) == (0, epoch)
    assert not other.pins and ns.mgr.counts().pinned == 1
    protocols(core).completions.complete_load(b, [key(1)], "", epoch)
    assert not b.pins and ns.mgr.counts().pinned == 0


# --- eviction ---------------------------------------------------------------------------------


def test_stores_into_granted_slots_evict_in_lru_order_and_never_a_pinned_block():
    """A full namespace of 8 slots: six ready blocks stored by six requests in order, key 1
    used again by a later request; the session's reserve wants its slots back, so each
    StoreGranted evicts what vLLM's prepare_store would: least recently used first."""
    core, a, b = two_sessions(pool=64 << 10, extent=64 << 10)    # 8 slots
    fp = protocols(core).fastpath
    offsets = fp.grant(a, 8)
    for i in range(6):
        assert store(core, a, [key(i)], offsets[i:i + 1], f"r{i}").evicted == []
    fp.set_reserve(a, 2)                                 # the two slots it still holds
    core.touch(a, [key(1)], "again")
    core.request_finished(a, "again")

    def stores(n: int, names: list[bytes], req_id: str) -> list[bytes]:
        granted = fp.grant(a, n) if n else [a.ns.slots.offset(s) for s in sorted(a.granted)]
        return store(core, a, names, granted, req_id).evicted

    assert stores(0, [key(10), key(11)], "n1") == [key(0), key(2)]
    pinned, epoch = fp.pin_loads(b, [key(3)], [offset_of(a, key(3))], "", None)
    assert pinned == 1
    assert stores(2, [key(12), key(13)], "n2") == [key(4), key(5)]     # key 3 is pinned
    protocols(core).completions.complete_load(b, [key(3)], "", epoch)
    assert stores(2, [key(14), key(15)], "n3") == [key(3), key(1)]
