"""KvdCore: sessions, tenants, namespaces, ownership, leases, liveness, reset, drain."""

from __future__ import annotations

import grpc
import pytest

from kvd_proto.wire import KvLayout as Layout
from kvd_server.core.core import KvdCore
from kvd_server.core.peer import PeerCred
from kvd_server.core.sessions import EngineInfo
from kvd_server.errors import KvdError
from kvd_server.manager import Lookup
from kvd_server.memory.extents import ExtentAllocator
from tests.support.core import LAYOUT, keys, make_core, protocols, session, stats


def code(exc_info) -> grpc.StatusCode:
    return grpc.StatusCode[exc_info.value.code]


def pool_accounting(core: KvdCore) -> None:
    doc = stats(core)
    assert doc["pool"]["free_bytes"] + doc["pool"]["used_bytes"] == doc["pool"]["total_bytes"]


def test_store_complete_lookup_load_across_sessions():
    core, _ = make_core()
    a, b = session(core), session(core)
    answer, epoch = protocols(core).callpath.prepare_store(a, keys(1, 2), "r1", None)
    assert not answer.cannot_store and answer.keys_to_store == keys(1, 2)
    assert protocols(core).callpath.lookup(b, keys(1, 2))[0] == [Lookup.HIT_PENDING] * 2
    # b cannot complete a's store
    assert protocols(core).completions.complete_store(b, keys(1, 2), True, "x", epoch).completed == 0
    assert protocols(core).completions.complete_store(a, keys(1, 2), True, "r1", epoch).completed == 2
    found = protocols(core).callpath.lookup(b, keys(1, 2, 3), prefix=True, lease_ms=1000)
    states, offsets = found.states, found.offsets
    assert states == [Lookup.HIT, Lookup.HIT, Lookup.MISS]
    assert offsets[:2] == answer.slot_offsets and offsets[2] == 0
    loaded, _ = protocols(core).callpath.prepare_load(b, keys(1, 2), "r2", None)
    assert loaded == answer.slot_offsets
    assert stats(core)["stats"]["pins"] == 2 and stats(core)["stats"]["leases"] == 0
    # a cannot release b's pins
    protocols(core).completions.complete_load(a, keys(1, 2), "r", epoch)
    assert stats(core)["stats"]["pins"] == 2
    protocols(core).completions.complete_load(b, keys(1, 2), "r2", epoch)
    assert stats(core)["stats"]["pins"] == 0


def test_namespaces_are_isolated_by_model_layout_and_tenant():
    core, _ = make_core(**{"tenants.uids": {"2000": "team-b"}})
    a = session(core, model="m1")
    other_model = session(core, model="m2")
    other_tenant = session(core, uid=2000, model="m1")
    other_layout = session(core, model="m1", layout=Layout(4096, 1, 4096, 16, "bf16"))
    answer, epoch = protocols(core).callpath.prepare_store(a, keys(7), "r", None)
    protocols(core).completions.complete_store(a, keys(7), True, "r", epoch)
    for s in (other_model, other_tenant, other_layout):
        assert protocols(core).callpath.lookup(s, keys(7))[0] == [Lookup.MISS]
        with pytest.raises(KvdError) as e:
            protocols(core).callpath.prepare_load(s, keys(7), "r", None)
        assert code(e) == grpc.StatusCode.FAILED_PRECONDITION
    assert other_tenant.tenant == "team-b"
    assert len(stats(core)["namespaces"]) == 4


def test_lease_expires_and_becomes_evictable():
    core, clock = make_core(pool=64 << 10, extent=64 << 10)   # 8 slots of 8 KiB
    a, b = session(core), session(core)
    _, epoch = protocols(core).callpath.prepare_store(a, keys(*range(8)), "r", None)
    protocols(core).completions.complete_store(a, keys(*range(8)), True, "r", epoch)
    protocols(core).callpath.lookup(b, keys(*range(8)), lease_ms=500)
    assert protocols(core).callpath.prepare_store(a, keys(9), "r", None)[0].cannot_store   # all leased
    clock.now += 1.0
    core.sweep()
    assert stats(core)["stats"]["leases_expired_total"] == 8
    assert not protocols(core).callpath.prepare_store(a, keys(9), "r", None)[0].cannot_store


def test_dead_session_releases_pins_and_pending_stores():
    core, clock = make_core()
    a, b = session(core), session(core)
    _, epoch = protocols(core).callpath.prepare_store(a, keys(1), "r", None)
    protocols(core).completions.complete_store(a, keys(1), True, "r", epoch)
    protocols(core).callpath.prepare_load(b, keys(1), "r", None)
    protocols(core).callpath.prepare_store(b, keys(2, 3), "r", None)
    clock.now += 3
    core.heartbeat(a)
    clock.now += 3          # b silent for 6 s > 5 s
    core.sweep()
    doc = stats(core)
    assert doc["sessions"] == 1 and doc["clients"]["reaped_total"] == 1
    assert doc["stats"]["pins"] == 0
    assert doc["blocks"] == {"storing": 0, "ready": 1, "pinned": 0, "zombie": 0, "retained": 0,
                             "total": 1}
    assert protocols(core).callpath.lookup(a, keys(2))[0] == [Lookup.MISS]
    with pytest.raises(KvdError) as e:
        core.authenticate(b.token)
    assert code(e) == grpc.StatusCode.UNAUTHENTICATED
    pool_accounting(core)


def test_reset_with_copies_in_flight():
    core, _ = make_core()
    a = session(core)
    ans, e0 = protocols(core).callpath.prepare_store(a, keys(1, 2), "r", None)
    protocols(core).completions.complete_store(a, keys(1), True, "r", e0)
    protocols(core).callpath.prepare_load(a, keys(1), "r", None)
    new_epoch, dropped = core.reset_namespace(a)
    assert (new_epoch, dropped) == (1, 2)
    assert stats(core)["blocks"]["zombie"] == 2
    assert protocols(core).callpath.lookup(a, keys(1, 2))[0] == [Lookup.MISS, Lookup.MISS]
    # completions from the old epoch are ignored and free the zombies
    assert protocols(core).completions.complete_store(a, keys(2), True, "r", e0).ignored
    assert protocols(core).completions.complete_load(a, keys(1), "r", e0) is True
    assert stats(core)["blocks"]["zombie"] == 0
    assert protocols(core).callpath.lookup(a, keys(2))[0] == [Lookup.MISS]
    with pytest.raises(KvdError) as e:
        protocols(core).completions.complete_load(a, keys(1), "r", 7)
    assert code(e) == grpc.StatusCode.FAILED_PRECONDITION
    pool_accounting(core)


def test_drain_refuses_stores_and_attaches():
    core, _ = make_core()
    a = session(core)
    core.start_drain()
    with pytest.raises(KvdError) as e:
        protocols(core).callpath.prepare_store(a, keys(1), "r", None)
    assert code(e) == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(KvdError) as e:
        core.attach(PeerCred(1, 1000, 1000))
    assert code(e) == grpc.StatusCode.UNAVAILABLE
    assert protocols(core).callpath.lookup(a, keys(1))[0] == [Lookup.MISS]   # lookups still answer


def test_allowlist_and_max_sessions():
    core, _ = make_core(**{"server.allowed_uids": [1000], "server.max_sessions": "2"})
    with pytest.raises(KvdError) as e:
        core.attach(PeerCred(1, 1234, 1234))
    assert code(e) == grpc.StatusCode.PERMISSION_DENIED and "1234" in str(e.value)
    core.attach(PeerCred(1, 1000, 1000))
    core.attach(PeerCred(1, 1000, 1000))
    with pytest.raises(KvdError) as e:
        core.attach(PeerCred(1, 1000, 1000))
    assert code(e) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_unregistered_and_reregister():
    core, _ = make_core()
    s = core.attach(PeerCred(1, 1000, 1000))
    with pytest.raises(KvdError) as e:
        protocols(core).callpath.lookup(s, keys(1))
    assert code(e) == grpc.StatusCode.FAILED_PRECONDITION
    core.register(s, EngineInfo(), "m", LAYOUT, "")
    core.register(s, EngineInfo(), "m", LAYOUT, "")          # same: no-op
    with pytest.raises(KvdError) as e:
        core.register(s, EngineInfo(), "other", LAYOUT, "")
    assert code(e) == grpc.StatusCode.FAILED_PRECONDITION


def test_block_larger_than_extent_is_invalid():
    core, _ = make_core(extent=64 << 10)
    s = core.attach(PeerCred(1, 1000, 1000))
    with pytest.raises(KvdError) as e:
        core.register(s, EngineInfo(), "m", Layout(1 << 20, 1, 1 << 20), "")
    assert code(e) == grpc.StatusCode.INVALID_ARGUMENT and "extent" in str(e.value)


def test_admin_reset_unknown_namespace():
    core, _ = make_core()
    with pytest.raises(KvdError) as e:
        core.admin_reset("nope")
    assert code(e) == grpc.StatusCode.NOT_FOUND


def test_a_full_pool_gives_every_namespace_its_fair_share():
    """The first namespace to fill the pool does not keep it: a second one that asks takes a
    whole extent from it (fair share), then each evicts within its own share."""
    core, _ = make_core(pool=128 << 10, extent=64 << 10)     # 2 extents x 8 slots
    a = session(core, model="a")
    b = session(core, model="b")
    _, e = protocols(core).callpath.prepare_store(a, keys(*range(16)), "r", None)
    protocols(core).completions.complete_store(a, keys(*range(16)), True, "r", e)
    ans, e = protocols(core).callpath.prepare_store(b, keys(100), "r", None)
    assert not ans.cannot_store and ans.keys_to_store == keys(100)
    rows = {ns["model"]: ns for ns in stats(core)["namespaces"]}
    assert rows["a"]["extents"] == 1 and rows["a"]["evictions_total"] == 8
    assert rows["b"]["extents"] == 1
    assert sum(s is Lookup.HIT for s in protocols(core).callpath.lookup(a, keys(*range(16))).states) == 8
    protocols(core).completions.complete_store(b, keys(100), True, "r", e)
    ans, e = protocols(core).callpath.prepare_store(b, keys(*range(101, 109)), "r", None)   # 7 free + 1 own
    assert len(ans.keys_to_store) == 8 and len(ans.evicted_keys) == 1
    protocols(core).completions.complete_store(b, ans.keys_to_store, True, "r", e)
    ans, e = protocols(core).callpath.prepare_store(a, keys(50), "r", None)                  # a evicts its own
    assert len(ans.evicted_keys) == 1
    protocols(core).completions.complete_store(a, keys(50), False, "r", e)
    assert {ns["model"]: ns["extents"] for ns in stats(core)["namespaces"]} == {"a": 1, "b": 1}
    pool_accounting(core)
    core.admin_reset(None)
    assert stats(core)["pool"]["extents_free"] == 2


def test_a_namespace_nobody_uses_gives_way_and_quotas_still_hold():
    core, _ = make_core(pool=256 << 10, extent=64 << 10,
                        **{"tenants.uids": "2000=t2", "tenants.quotas": "t2=64KiB"})
    a = session(core, model="a")
    _, e = protocols(core).callpath.prepare_store(a, keys(*range(32)), "r", None)          # the whole pool
    protocols(core).completions.complete_store(a, keys(*range(32)), True, "r", e)
    core.close_session(a, "engine exited", copies_done=True)           # its blocks stay
    b = session(core, model="b")
    ans, e = protocols(core).callpath.prepare_store(b, keys(*range(100, 116)), "r", None)  # half the pool
    assert len(ans.keys_to_store) == 16 and not ans.evicted_keys
    protocols(core).completions.complete_store(b, ans.keys_to_store, True, "r", e)
    c = session(core, uid=2000, model="c")                              # quota: one extent
    ans, e = protocols(core).callpath.prepare_store(c, keys(*range(200, 208)), "r", None)  # its share, from a
    assert len(ans.keys_to_store) == 8 and not ans.evicted_keys
    protocols(core).completions.complete_store(c, ans.keys_to_store, True, "r", e)
    ans, _ = protocols(core).callpath.prepare_store(c, keys(*range(208, 212)), "r", None)  # at its quota
    assert len(ans.evicted_keys) == 4
    doc = stats(core)
    assert doc["tenants"]["t2"]["used_bytes"] == 64 << 10
    assert {ns["model"]: ns["extents"] for ns in doc["namespaces"]} == {"a": 1, "b": 2, "c": 1}
    pool_accounting(core)


def test_stats_document_shape():
    core, _ = make_core()
    session(core)
    doc = stats(core)
    for section in ("server", "pool", "blocks", "namespaces", "clients", "stats", "transfers"):
        assert section in doc
    assert isinstance(doc["sessions"], int)
    assert set(doc["blocks"]) == {"storing", "ready", "pinned", "zombie", "retained", "total"}
    assert doc["retention"] == {"hints_total": 0, "hints_refused_total": 0, "tenants": {}}


def test_slots_of_a_dead_writer_are_quarantined_until_its_process_is_gone():
    cfg_core, clock = make_core(pool=64 << 10, extent=64 << 10)      # 8 slots
    alive = {4242: True}
    core = KvdCore(cfg_core.config, ExtentAllocator(64 << 10, 64 << 10), clock=clock,
                   alive=lambda pid: alive.get(pid, False))
    core.set_serving()
    writer = core.attach(PeerCred(pid=4242, uid=1000, gid=1000))
    core.register(writer, EngineInfo(), "m", LAYOUT, "")
    ans, _ = protocols(core).callpath.prepare_store(writer, keys(1), "r", None)
    core.close_session(writer, "stream closed")        # mid-store; the process still runs
    other = session(core)
    grant, _ = protocols(core).callpath.prepare_store(other, keys(*range(10, 17)), "r", None)
    assert ans.slot_offsets[0] not in grant.slot_offsets    # never reused while it may write
    assert stats(core)["pool"]["quarantined_slots"] == 1
    protocols(core).completions.complete_store(other, grant.keys_to_store, True, "r", 0)
    clock.now += 60
    core.heartbeat(other)
    core.sweep()                                     # still alive: still quarantined
    assert stats(core)["pool"]["quarantined_slots"] == 1
    alive[4242] = False
    core.sweep()
    assert stats(core)["pool"]["quarantined_slots"] == 0
    grant, _ = protocols(core).callpath.prepare_store(other, keys(20), "r", None)
    assert grant.slot_offsets == ans.slot_offsets and not grant.evicted_keys


def test_tenant_quota_caps_its_extents_and_never_touches_another_tenant():
    # 1 MiB pool of four 256 KiB extents, 32 slots of 8 KiB each; team-a may hold one extent.
    core, _ = make_core(**{"tenants.uids": {"2000": "team-a", "3000": "team-b"},
                           "tenants.quotas": {"team-a": "256KiB"}})
    a1, a2 = session(core, uid=2000, model="m1"), session(core, uid=2000, model="m2")
    b = session(core, uid=3000, model="m1")
    answer, epoch = protocols(core).callpath.prepare_store(b, keys(*range(40)), "r", None)
    assert not answer.cannot_store
    protocols(core).completions.complete_store(b, keys(*range(40)), True, "r", epoch)     # b: 2 extents
    answer, epoch = protocols(core).callpath.prepare_store(a1, keys(*range(32)), "r", None)
    assert not answer.cannot_store
    # a1 holds team-a's only extent with stores in flight: a2 (same tenant) gets no room,
    # although the pool still has a free extent.
    assert protocols(core).callpath.prepare_store(a2, keys(100), "r", None)[0].cannot_store
    protocols(core).completions.complete_store(a1, keys(*range(32)), True, "r", epoch)
    # At its quota, team-a evicts its own blocks to store more; team-b keeps every block.
    answer, epoch = protocols(core).callpath.prepare_store(a1, keys(*range(32, 40)), "r", None)
    assert not answer.cannot_store and len(answer.keys_to_store) == 8
    assert sorted(answer.evicted_keys) == sorted(keys(*range(8)))
    protocols(core).completions.complete_store(a1, keys(*range(32, 40)), True, "r", epoch)
    assert protocols(core).callpath.lookup(b, keys(*range(40)))[0] == [Lookup.HIT] * 40
    doc = stats(core)
    assert doc["tenants"]["team-a"] == {"used_bytes": 256 << 10, "quota_bytes": 256 << 10}
    assert doc["tenants"]["team-b"]["quota_bytes"] == 0
    assert doc["pool"]["extents_free"] == 1
    # team-b has no quota: it may take the last extent.
    answer, epoch = protocols(core).callpath.prepare_store(b, keys(*range(40, 72)), "r", None)
    assert not answer.cannot_store and not answer.evicted_keys
    pool_accounting(core)


def test_tenant_quota_smaller_than_an_extent_is_a_config_error():
    with pytest.raises(ValueError, match="smaller than one extent"):
        make_core(**{"tenants.quotas": {"team-a": "4KiB"}})


def test_a_daemon_stall_is_forgiven_not_blamed_on_the_sessions():
    core, clock = make_core()
    a = session(core)
    protocols(core).callpath.prepare_store(a, keys(1), "r", None)
    clock.now += 30            # the daemon was stopped for 30 s: nobody could be heard
    core.forgive(30)
    core.sweep()
    assert stats(core)["sessions"] == 1 and stats(core)["blocks"]["storing"] == 1
    clock.now += 6             # then 6 s of real silence (> 5 s liveness): reaped
    core.sweep()
    assert stats(core)["sessions"] == 0 and stats(core)["blocks"]["storing"] == 0


def test_complete_load_without_a_pin_gives_back_the_sessions_lease_only():
    core, _ = make_core(pool=64 << 10, extent=64 << 10)   # 8 slots
    a, b = session(core), session(core)
    _, epoch = protocols(core).callpath.prepare_store(a, keys(*range(8)), "r", None)
    protocols(core).completions.complete_store(a, keys(*range(8)), True, "r", epoch)
    protocols(core).callpath.lookup(a, keys(0, 1), lease_ms=5000)
    protocols(core).callpath.lookup(b, keys(1), lease_ms=5000)
    assert stats(core)["stats"]["leases"] == 3
    protocols(core).completions.complete_load(b, keys(0), "r", epoch)        # b never leased key 0
    assert stats(core)["stats"]["leases"] == 3
    protocols(core).completions.complete_load(a, keys(0, 1), "r", epoch)     # a gives back both its leases
    assert stats(core)["stats"]["leases"] == 1
    # key 0 is evictable again; key 1 is still protected by b's lease.
    answer, _ = protocols(core).callpath.prepare_store(a, keys(9), "r", None)
    assert answer.evicted_keys and keys(1)[0] not in answer.evicted_keys


def test_a_store_bound_after_a_reset_the_engine_had_not_seen_fails_at_its_completion():
    """The engine read reset epoch E, another session reset, then the daemon read the store:
    it is bound at E + 1 while the engine completes it naming E. It must not stay "being
    stored" forever (every reader PENDING, its slot held), nor serve bytes of the dropped
    epoch: the completion fails it, its slot is free again and the key absent."""
    core, _ = make_core()
    a, b = session(core), session(core)
    fp = protocols(core).fastpath
    offsets = fp.grant(a, 4)
    engine_epoch = a.ns.index.reset_epoch           # what the engine read at its step start
    core.reset_namespace(b)                         # before the daemon reads a's store
    answer = fp.store_granted(a, keys(1), "r", None, keys(1), offsets[:1])
    assert answer.accepted == 1 and answer.epoch == engine_epoch + 1
    free = a.ns.slots.free_count()
    protocols(core).completions.complete_store(a, keys(1), True, "r", engine_epoch)
    assert a.pending == {}, "the store stayed pending: its slot is held for good"
    assert protocols(core).callpath.lookup(b, keys(1)).states == [Lookup.MISS]
    assert a.ns.slots.free_count() == free + 1
    # A store made knowing the new epoch completes as ever.
    answer = fp.store_granted(a, keys(2), "r", None, keys(2), offsets[1:2])
    protocols(core).completions.complete_store(a, keys(2), True, "r", answer.epoch)
    assert protocols(core).callpath.lookup(b, keys(2)).states == [Lookup.HIT]
