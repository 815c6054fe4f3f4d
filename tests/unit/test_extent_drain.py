"""Extents taken from a namespace whose freed slots wait in limbo (NamespaceSlots.drain), and
the namespace table's bounds: idle namespaces forgotten, namespaces per tenant limited."""

from __future__ import annotations

import pytest

from kvd_proto.wire import KvLayout
from kvd_server.config import TenantsConfig
from kvd_server.core.namespaces import NamespaceTable
from kvd_server.errors import KvdError
from kvd_server.memory.extents import ExtentAllocator, NamespaceSlots

PAGE = 4096


class FakeLimbo:
    """Freed slots held until `release()` (a reader that has not moved on yet)."""

    def __init__(self) -> None:
        self.held: list[int] = []
        self.out: list[int] = []
        self.in_limbo = 0

    @property
    def active(self) -> bool:
        return True

    def retire(self, slot: int) -> None:
        self.held.append(slot)
        self.in_limbo += 1

    def release(self) -> None:
        self.out, self.held = self.out + self.held, []

    def collect(self) -> list[int]:
        out, self.out = self.out, []
        self.in_limbo -= len(out)
        return out


def test_a_draining_extent_hands_out_nothing_and_goes_to_its_taker_once_out_of_limbo():
    pool = ExtentAllocator(4 * 4 * PAGE, 4 * PAGE)           # 4 extents x 4 slots
    victim = NamespaceSlots(pool, PAGE, limbo=(limbo := FakeLimbo()))
    taker = NamespaceSlots(pool, PAGE)
    slots = victim.allocate(16)                               # the whole pool
    extent = slots[5] // 4                                    # extent 1: slots 4..7
    for slot in slots[4:7]:
        victim.free(slot)                                     # 3 freed, still in limbo
    assert victim.free_count() == 0 and victim.retired_in(extent) == 3   # in use till out
    victim.free(slots[7])                                     # the 4th: the extent's last
    assert not victim.drain(extent, taker)                    # its slots are still in limbo
    assert victim.is_draining(extent) and taker.incoming == 1
    assert victim.free_count() == 0 and victim.capacity() == 16
    limbo.release()
    victim.collect()                                          # the last one leaves limbo
    assert not victim.is_draining(extent) and victim.extents_held() == 3
    assert taker.held() == [extent] and taker.incoming == 0 and taker.free_count() == 4
    assert victim.capacity() == 12 and victim.free_count() == 0
    assert sorted(taker.allocate(4)) == list(range(4, 8))


def test_an_extent_drained_for_a_namespace_that_is_gone_stays_in_the_pool():
    pool = ExtentAllocator(2 * 4 * PAGE, 4 * PAGE)
    victim = NamespaceSlots(pool, PAGE, limbo=(limbo := FakeLimbo()))
    taker = NamespaceSlots(pool, PAGE)
    for slot in victim.allocate(8)[:4]:
        victim.free(slot)
    assert not victim.drain(0, taker)
    taker.closed = True
    limbo.release()
    victim.collect()
    assert pool.free_extents() == 1 and taker.extents_held() == 0 and taker.incoming == 0


LAYOUT = KvLayout(PAGE, 1, PAGE, 16, "bfloat16")


def table(**tenants: object) -> tuple[NamespaceTable, list[float]]:
    now = [0.0]
    cfg = TenantsConfig(**tenants)                            # type: ignore[arg-type]
    return NamespaceTable(ExtentAllocator(16 * PAGE, 4 * PAGE), "lru", cfg,
                          clock=lambda: now[0]), now


def test_a_namespace_without_session_and_block_is_forgotten_after_the_idle_timeout():
    t, now = table(namespace_idle_timeout=5.0)
    idle = t.join("idle", LAYOUT, "", "a")
    kept = t.join("kept", LAYOUT, "", "a")
    grant = kept.mgr.prepare_store([b"k"])
    assert grant is not None
    t.leave(idle)
    t.leave(kept)
    assert t.collect_idle() == 0 and len(t) == 2              # idle since now
    now[0] = 4.9
    assert t.collect_idle() == 0 and len(t) == 2
    now[0] = 5.0
    assert t.collect_idle() == 1                              # what the sweeper calls
    assert [ns.model for ns in t] == ["kept"]                 # a block: not idle
    assert idle.slots.closed and t.forgotten_total == 1


def test_a_tenant_at_its_namespace_limit_is_refused_naming_the_setting():
    t, _ = table(max_namespaces=2, namespace_idle_timeout=3600.0)
    a = [t.join(f"m{i}", LAYOUT, "", "a") for i in range(2)]
    with pytest.raises(KvdError) as e:
        t.join("m2", LAYOUT, "", "a")
    assert e.value.code == "RESOURCE_EXHAUSTED"
    assert "tenants.max_namespaces = 2" in str(e.value) and "'a'" in str(e.value)
    t.join("m0", LAYOUT, "", "b")                             # another tenant: its own limit
    t.leave(a[0])                                             # unused: gives way at once
    assert t.join("m2", LAYOUT, "", "a").model == "m2"
    assert sorted(ns.model for ns in t if ns.tenant == "a") == ["m1", "m2"]


def test_slots_at_is_slot_at_for_every_offset():
    """A record's offsets turned into slots in one call (kvd_server/protocols/fastpath.py) answer as
    slot_at does one by one: in-range offsets of extents held, None for any other."""
    pool = ExtentAllocator(4 * 4 * 2 * PAGE, 4 * 2 * PAGE)    # 4 extents x 4 slots of 2 pages
    slots = NamespaceSlots(pool, 2 * PAGE)
    slots.allocate(9)                                          # holds 3 of the 4 extents
    extent = 4 * 2 * PAGE
    offsets = [o for o in range(-2 * PAGE, 5 * extent, PAGE // 2)] + [2**63, 7]
    assert slots.slots_at(offsets) == [slots.slot_at(o) for o in offsets]
    assert any(s is not None for s in slots.slots_at(offsets))
    assert any(s is None for s in slots.slots_at(offsets))
