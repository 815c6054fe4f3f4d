"""A tier's optional capabilities come with `Tier`'s defaults, and a tier reaches a namespace's
manager through one port (`BelowPort`, the demoter bound to it; `NO_BELOW` without a tier):
what the pool evicts goes down before its slot is freed, what it stores is published by a tier
that shares, a reset drops what is held below."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future

import pytest

from kvd_proto.below_layout import FLAG_ASK
from kvd_proto.wire import KvLayout
from kvd_server.config import PoolConfig, TenantsConfig
from kvd_server.core.namespaces import NamespaceTable
from kvd_server.manager import FixedSlots, NamespaceManager
from kvd_server.manager.types import NO_BELOW
from kvd_server.memory.extents import ExtentAllocator
from kvd_server.memory.tenant_pools import TenantPools
from kvd_server.tiers.base import Tier, TierKey, TierStats, done_future, succeeded
from kvd_server.tiers.demotion import NamespaceDemoter
from kvd_server.tiers.link import TierLink
from kvd_server.tiers.stack import TierStack

PAGE = 4096
LAYOUT = KvLayout(PAGE, 1, PAGE, 16, "bfloat16")


class MemoryTier(Tier):
    """A tier of this node alone, in memory: only what every tier must do."""

    name = "memory"

    def __init__(self) -> None:
        self.blocks: dict[TierKey, bytes] = {}
        self.on_dropped: Callable[[list[TierKey]], None] | None = None
        self.reset_namespaces: list[str] = []

    @property
    def readable(self) -> bool:
        return True

    def contains(self, key: TierKey) -> bool:
        return key in self.blocks

    def keys(self, namespace: str) -> list[bytes]:
        return [k.key for k in self.blocks if k.namespace == namespace]

    def demote(self, key: TierKey, data: memoryview | bytes) -> Future[bool] | None:
        self.blocks[key] = bytes(data)
        return done_future(True)

    def promote(self, key: TierKey, dest: memoryview) -> Future[bool] | None:
        block = self.blocks.get(key)
        if block is None:
            return None
        dest[:len(block)] = block
        return done_future(True)

    def remove(self, key: TierKey) -> bool:
        return self.blocks.pop(key, None) is not None

    def remove_namespace(self, namespace: str) -> int:
        self.reset_namespaces.append(namespace)
        gone = [k for k in self.blocks if k.namespace == namespace]
        for k in gone:
            del self.blocks[k]
        return len(gone)

    def stats(self) -> TierStats:
        return TierStats(self.name, capacity_bytes=64 * PAGE, blocks=len(self.blocks))

    def close(self) -> None:
        self.blocks.clear()


class SharingTier(MemoryTier):
    """A tier that shares blocks between nodes: every stored block published, namespaces
    watched (as the cluster tier does)."""

    name = "sharing"
    publishes_stored = True

    def __init__(self) -> None:
        super().__init__()
        self.watched: list[tuple[str, str]] = []
        self.published: list[bytes] = []
        self.asked: list[list[bytes]] = []

    def join_namespace(self, namespace: str, tenant: str, block_bytes: int = 0) -> None:
        self.watched.append((namespace, tenant))

    def publish(self, key: TierKey, data: memoryview | bytes) -> Future[bool] | None:
        self.published.append(key.key)
        return self.demote(key, data)

    def find_flags(self, tenant: str) -> int:
        return FLAG_ASK if tenant == "default" else 0     # only "default" shares

    def find(self, namespace: str, keys: Sequence[bytes]) -> Future[list[bytes]] | None:
        self.asked.append(list(keys))
        return done_future([])  # type: ignore[return-value]


def test_a_tier_of_this_node_alone_has_every_optional_capability_by_default():
    tier = MemoryTier()
    assert tier.parts == (tier,)
    assert not tier.publishes_stored and tier.on_named is None
    tier.join_namespace("ns", "tenant")                        # nothing to watch
    key = TierKey("ns", b"k", "tenant")
    assert succeeded(tier.publish(key, b"block"))              # a demotion by default
    assert tier.blocks == {key: b"block"}


def test_a_stack_is_made_of_its_two_tiers_and_joins_each():
    upper, lower = MemoryTier(), SharingTier()
    stack = TierStack(upper, lower)
    assert stack.parts == (upper, lower) and stack.publishes_stored
    stack.join_namespace("ns", "tenant")
    assert lower.watched == [("ns", "tenant")]
    named: list[tuple[list[TierKey], bool]] = []
    stack.on_named = lambda keys, found: named.append((keys, found))
    assert lower.on_named is not None
    lower.on_named([TierKey("ns", b"k")], True)                # another node published it
    assert named == [([TierKey("ns", b"k")], True)]
    assert not TierStack(MemoryTier(), MemoryTier()).publishes_stored


class RecordingPort:
    """A `BelowPort` that keeps the victims in `keep` and records what it is told."""

    def __init__(self, keep: Collection[bytes] = ()) -> None:
        self.keep = set(keep)
        self.demoted: list[tuple[bytes, int]] = []
        self.stored_told: list[tuple[list[bytes], list[int]]] = []
        self.resets = 0

    def demote(self, victims: Sequence[tuple[bytes, int]]) -> Collection[bytes]:
        self.demoted += victims
        return {key for key, _ in victims if key in self.keep}

    def stored(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        self.stored_told.append((list(keys), list(slots)))

    def reset(self) -> int:
        self.resets += 1
        return 0


def _store(m: NamespaceManager, *keys: bytes) -> list[int]:
    grant = m.prepare_store(list(keys))
    assert grant is not None
    m.complete_store(grant.keys_to_store)
    return grant.slots


def _removed(m: NamespaceManager) -> set[bytes]:
    events, _ = m.take_events()
    return {k for e in events if e.removed for k in e.keys}


def test_without_a_tier_an_eviction_is_a_removed_block():
    m = NamespaceManager(FixedSlots(2))
    assert m.below is NO_BELOW
    _store(m, b"a0000", b"b0000")
    _store(m, b"c0000")                                        # evicts a (LRU)
    assert _removed(m) == {b"a0000"}
    m.reset()                                                  # nothing below to tell


def test_the_port_hears_evictions_stores_and_resets():
    m = NamespaceManager(FixedSlots(2))
    port = RecordingPort(keep={b"a0000"})
    m.attach_below(port)
    slots = _store(m, b"a0000", b"b0000")
    assert port.stored_told == [([b"a0000", b"b0000"], slots)]
    _store(m, b"c0000", b"d0000")                             # evicts both
    assert sorted(port.demoted) == sorted(zip([b"a0000", b"b0000"], slots))
    assert _removed(m) == {b"b0000"}                           # a is held below
    m.lost_below([b"a0000"])                                   # ... until the tier drops it
    assert _removed(m) == {b"a0000"}
    m.reset()
    assert port.resets == 1


@pytest.fixture
def joined() -> Iterator[tuple[SharingTier, NamespaceTable, TenantPools]]:
    extents = ExtentAllocator(16 * PAGE, 4 * PAGE)
    table = NamespaceTable(extents, "lru", TenantsConfig())
    pools = TenantPools(PoolConfig(16 * PAGE, "memfd", "", False, False, False, 4 * PAGE,
                                   False))
    pools.extent_bytes = 4 * PAGE
    loop = asyncio.new_event_loop()
    tier = SharingTier()
    link = TierLink(tier, table, pools, loop)
    try:
        yield tier, table, pools
    finally:
        link.close()
        pools.close()
        loop.close()


def test_the_link_joins_each_namespace_through_its_port(joined):
    tier, table, pools = joined
    ns = table.join("model", LAYOUT, "", "default")
    assert isinstance(ns.mgr.below, NamespaceDemoter)
    assert tier.watched == [(ns.id, "default")]
    grant = ns.mgr.prepare_store([b"k0000"])
    assert grant is not None
    start = ns.slots.offset(grant.slots[0])
    pools.for_tenant("default").view()[start:start + PAGE] = b"\x07" * PAGE
    ns.mgr.complete_store([b"k0000"])                          # published as it is stored
    assert tier.published == [b"k0000"]
    assert tier.blocks[TierKey(ns.id, b"k0000", "default")] == b"\x07" * PAGE
    ns.mgr.reset()                                             # drops what is held below
    assert tier.reset_namespaces == [ns.id] and not tier.blocks


def test_the_link_asks_the_tier_only_for_a_tenant_it_shares(joined):
    """A FIND (or a call-protocol miss) of a tenant whose blocks never leave the node asks
    nothing, whatever its engine sends: its table never says FLAG_ASK either."""
    tier, table, pools = joined
    link = next(cb.__self__ for cb in table.on_made if isinstance(cb.__self__, TierLink))
    shared = table.join("model", LAYOUT, "", "default")
    private = table.join("model", LAYOUT, "", "private")
    assert link.table(shared.id).flags == FLAG_ASK and link.table(private.id).flags == 0
    assert link.find(private, [b"k1"], lambda: None) is False and tier.asked == []
    assert link.find(shared, [b"k1"], lambda: None) is True and tier.asked == [[b"k1"]]
