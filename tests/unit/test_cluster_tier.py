"""The cluster tier's logic over an in-memory store with Mooncake's semantics (names to bytes,
a master that may go down and come back empty): publication, finding other nodes' blocks on
demand (one batched call, absent keys remembered), promotion with its checksum, tenants
apart, degradation and recovery. The real store runs in tests/multiproc/test_cluster_tier.py."""

from __future__ import annotations

import threading
import time

import pytest

from kvd_proto.below_layout import FLAG_ASK, FLAG_WAIT
from kvd_server.tiers.base import TierHealth, TierKey
from kvd_server.tiers.cluster import directory
from kvd_server.tiers.cluster.names import (
    StoreFormatError,
    block_name,
    check_block,
    encode_block,
)
from kvd_server.tiers.cluster.store import TRANSFER_FAIL, StoreError
from kvd_server.tiers.cluster.tier import PROBE, ClusterTier

BLOCK = 4096


class MemoryStore:
    """A store shared by the tiers of one test (one per node), with a master that can go
    down (every call fails) and come back having lost everything."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.down = False
        self.put_delay = 0.0
        self.lost_puts = 0           # the next puts fail as Mooncake's do when a replica's
        self.lock = threading.Lock()  # node died (TRANSFER_FAIL)
        self.exists_calls = 0
        self.connects = 0

    def client(self) -> MemoryStore:
        if self.down:
            raise StoreError("master unreachable")
        self.connects += 1
        return self

    def _check(self) -> None:
        if self.down:
            raise StoreError("master unreachable", -900)

    def put(self, name: str, value: bytes) -> None:
        self._check()
        time.sleep(self.put_delay)
        with self.lock:
            if self.lost_puts:
                self.lost_puts -= 1
                raise StoreError(f"put {name}: code {TRANSFER_FAIL}", TRANSFER_FAIL)
            self.values[name] = bytes(value)

    def get(self, name: str) -> bytes | None:
        self._check()
        with self.lock:
            return self.values.get(name)

    def exists(self, names: list[str]) -> list[bool]:
        self._check()
        with self.lock:
            if names != [PROBE]:             # the tier's health check, every sync_s
                self.exists_calls += 1
            return [n in self.values for n in names]

    def remove_prefix(self, prefix: str) -> None:
        self._check()
        with self.lock:
            for name in [n for n in self.values if n.startswith(prefix)]:
                del self.values[name]

    def healthy(self) -> bool:
        return not self.down

    def close(self) -> None:
        pass

    def restart(self) -> None:
        """The master came back (non-HA): it lost every object."""
        with self.lock:
            self.values.clear()
        self.down = False


def wait(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def make_tier(store: MemoryStore):
    made: list[ClusterTier] = []

    def make(node: str, **kwargs) -> ClusterTier:
        tier = ClusterTier(store.client, node=node, capacity_bytes=64 << 20, sync_s=0.02,
                           retry_s=0.1, **kwargs)
        made.append(tier)
        wait(lambda: tier.readable, f"{node} to connect")
        return tier

    yield make
    for tier in made:
        tier.close()


def block(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK


def publish(tier: ClusterTier, key: TierKey, data: bytes) -> None:
    future = tier.demote(key, memoryview(data))
    assert future is not None and future.result(timeout=5)


def promote(tier: ClusterTier, key: TierKey) -> bytes | None:
    dest = bytearray(BLOCK + 512)
    future = tier.promote(key, memoryview(dest))
    return bytes(dest[:BLOCK]) if future is not None and future.result(timeout=5) else None


def find(tier, namespace: str, keys: list[bytes]) -> list[bytes]:
    future = tier.find(namespace, keys)
    assert future is not None
    return future.result(timeout=5)


def test_a_block_one_node_published_is_found_and_read_by_another(make_tier, store):
    """Node b's engines miss a key: one batched call asks the store, which holds a's block;
    b knows it from then on (held below) and reads it byte-exact. Nodes keep no lists."""
    a, b = make_tier("node-a"), make_tier("node-b")
    key = TierKey("ns1", b"k" * 40, "tenant")
    publish(a, key, block(7))
    assert a.contains(key) and store.get(block_name("ns1", key.key)) is not None
    assert not b.contains(key)                       # b learns nothing unasked
    absent = b"n" * 40
    assert find(b, "ns1", [key.key, absent]) == [key.key]
    assert store.exists_calls == 1 and b.contains(key)
    assert promote(b, key) == block(7)
    st = b.stats()
    assert st.promotions_total == 1 and st.hits_total == 1 and st.health == TierHealth.OK
    assert (st.finds_total, st.find_calls_total, st.found_total) == (2, 1, 1)
    assert sorted(store.values) == [block_name("ns1", key.key)]   # blocks only: no lists


def test_keys_known_or_found_absent_lately_cost_the_store_nothing(make_tier, store):
    a, b = make_tier("node-a"), make_tier("node-b")
    mine, theirs = TierKey("ns", b"mine"), TierKey("ns", b"theirs")
    publish(b, mine, block(1))
    # known: not asked, named again (a held-below entry may have gone: a promotion given up)
    assert find(b, "ns", [mine.key]) == [mine.key] and store.exists_calls == 0
    assert find(b, "ns", [theirs.key]) == [] and store.exists_calls == 1
    publish(a, theirs, block(2))
    assert find(b, "ns", [theirs.key]) == [] and store.exists_calls == 1  # absent lately
    later = time.monotonic() + directory.NEGATIVE_S
    b.directory._clock = lambda: later           # NEGATIVE_S on: asked again
    assert find(b, "ns", [theirs.key]) == [theirs.key] and store.exists_calls == 2


def test_finds_of_one_namespace_are_one_call_at_a_time(make_tier, store):
    """Keys asked while a call runs wait for the next one: however many engines ask, a
    namespace costs the store one call in flight."""
    b = make_tier("node-b")
    gate = threading.Event()
    real = store.exists

    def slow(names):
        gate.wait(5)
        return real(names)

    store.exists = slow
    futures = [b.find("ns", [bytes([i]) * 8]) for i in range(20)]
    time.sleep(0.05)
    gate.set()
    assert all(f is not None and f.result(timeout=5) == [] for f in futures)
    assert store.exists_calls == 2 and b.stats().finds_total == 20


def test_the_engines_are_told_to_ask_only_where_the_store_shares(make_tier):
    a = make_tier("node-a", shares=lambda tenant: tenant == "shared")
    assert a.find_flags("shared") == FLAG_ASK | FLAG_WAIT
    assert a.find_flags("private") == 0
    b = make_tier("node-b", wait_lookups=False)
    assert b.find_flags("") == FLAG_ASK


def test_another_namespace_never_sees_the_block(make_tier):
    """Namespaces are digests of tenant, model and layout: another tenant's engines (another
    namespace) find nothing, on any node."""
    a, b = make_tier("node-a"), make_tier("node-b")
    key = TierKey("ns1", b"shared-prefix", "t1")
    publish(a, key, block(1))
    other = TierKey("other-tenant-ns", key.key, "t2")
    assert find(b, other.namespace, [key.key]) == []
    assert not b.contains(other) and b.keys("other-tenant-ns") == []
    assert promote(b, other) is None


def test_a_corrupt_or_vanished_block_is_a_miss_and_forgotten(make_tier, store):
    a = make_tier("node-a")
    good, bad, gone = (TierKey("ns", bytes([i]) * 8) for i in range(3))
    for key in (good, bad, gone):
        publish(a, key, block(3))
    value = bytearray(store.values[block_name("ns", bad.key)])
    value[-1] ^= 0xFF                                # a flipped bit in the block
    store.values[block_name("ns", bad.key)] = bytes(value)
    del store.values[block_name("ns", gone.key)]     # the store evicted it
    dropped: list[TierKey] = []
    a.on_dropped = dropped.extend
    assert promote(a, good) == block(3)
    assert promote(a, bad) is None and promote(a, gone) is None
    assert not a.contains(bad) and not a.contains(gone) and a.contains(good)
    assert sorted(dropped, key=lambda k: k.key) == [bad, gone]
    st = a.stats()
    assert st.corrupt_total == 1 and st.misses_total >= 1 and st.failures_total == 0


def test_a_master_down_degrades_the_tier_which_recovers_and_forgets_what_was_lost(make_tier,
                                                                                  store):
    a, b = make_tier("node-a"), make_tier("node-b")
    key = TierKey("ns", b"before")
    publish(a, key, block(5))
    assert find(b, "ns", [key.key]) == [key.key]
    store.down = True
    wait(lambda: b.stats().health == TierHealth.DEGRADED, "b to degrade")
    assert not b.readable and promote(b, key) is None
    assert b.find("ns", [b"other"]) is None and b.find_flags("") == 0
    assert b.demote(TierKey("ns", b"refused"), memoryview(block(6))) is None
    store.restart()                                  # back, empty
    wait(lambda: a.readable and b.readable, "both to recover")
    wait(lambda: not b.contains(key), "b to forget what the master lost")
    assert promote(b, key) is None                   # never served from memory of it
    after = TierKey("ns", b"after")
    publish(a, after, block(9))
    assert find(b, "ns", [after.key]) == [after.key]
    assert promote(b, after) == block(9)


def test_a_master_unreachable_for_a_while_costs_no_segment_and_nothing_known(make_tier,
                                                                             store):
    """Not a restart: the master was unreachable (a network blip) and kept every object.
    The degraded tier finds its client answering again over a store that still holds its
    blocks: it serves on with the same client (its segment, with the blocks it holds for
    every node, never remounted) and forgets nothing."""
    a = make_tier("node-a")
    key = TierKey("ns", b"kept")
    publish(a, key, block(4))
    connects = store.connects
    store.down = True
    wait(lambda: a.stats().health == TierHealth.DEGRADED, "a to degrade")
    store.down = False                               # back, with everything
    wait(lambda: a.readable, "a to recover")
    assert store.connects == connects                # the same client: never recycled
    assert a.contains(key) and promote(a, key) == block(4)


def test_a_put_failing_for_its_replica_alone_never_degrades_the_tier(make_tier, store):
    """A node that died without leaving: puts placed on its segment fail (TRANSFER_FAIL)
    until the master drops it. That block is not published (counted as a failure), the
    tier serves on."""
    a, b = make_tier("node-a"), make_tier("node-b")
    store.lost_puts = 1
    lost = a.demote(TierKey("ns", b"lost"), memoryview(block(1)))
    assert lost is not None and lost.result(timeout=5) is False
    assert a.stats().health == TierHealth.OK and a.stats().failures_total == 1
    key = TierKey("ns", b"kept")
    publish(a, key, block(2))
    assert find(b, "ns", [key.key, b"lost"]) == [key.key]
    assert a.stats().health == TierHealth.OK and b.stats().health == TierHealth.OK
    assert promote(b, key) == block(2)
    assert not b.contains(TierKey("ns", b"lost"))


def test_publications_are_bounded_and_a_reset_drops_the_namespace_everywhere(make_tier,
                                                                            store):
    a = make_tier("node-a", queue_bytes=3 * BLOCK)
    store.put_delay = 0.05                           # a slow store: puts pile up
    keys = [TierKey("ns", bytes([i]) * 4) for i in range(16)]
    futures = [a.demote(k, memoryview(block(i))) for i, k in enumerate(keys)]
    taken = [f for f in futures if f is not None]
    assert 0 < len(taken) <= 2, "more publications in flight than the queue's bytes allow"
    assert all(f.result(timeout=5) for f in taken)
    st = a.stats()
    assert st.demotions_total == len(taken)
    assert st.demotions_refused_total == len(keys) - len(taken)
    store.put_delay = 0.0
    assert a.remove_namespace("ns") >= 1
    wait(lambda: not any(n.startswith("kvd/v1/b/ns/") for n in store.values),
         "the namespace's blocks to leave the store")
    assert a.keys("ns") == []


@pytest.mark.parametrize("value", [b"", b"KVDB", encode_block(b"x")[:-1],
                                   b"XXXX" + encode_block(b"x")[4:]])
def test_a_block_value_that_is_not_one_is_refused(value):
    with pytest.raises(StoreFormatError):
        check_block(value)


def test_the_disk_over_the_cluster_store_acts_as_one_tier(make_tier, store, tmp_path):
    """tiers/stack.py: evicted blocks go to the disk, promotions read the disk first and the
    store otherwise, and a block is told dropped only when neither holds it."""
    from kvd_server.tiers.disk.tier import DiskTier
    from kvd_server.tiers.stack import TierStack

    disk = DiskTier(str(tmp_path / "disk"), 16 << 20, extent_bytes=4 << 20, io_threads=2)
    other = make_tier("node-other")
    stack = TierStack(disk, make_tier("node-here"))
    dropped: list[TierKey] = []
    stack.on_dropped = dropped.extend
    try:
        stack.join_namespace("ns", "")
        evicted, shared = TierKey("ns", b"evicted"), TierKey("ns", b"shared")
        assert stack.publishes_stored
        future = stack.demote(evicted, memoryview(block(1)))     # eviction: the disk only
        assert future is not None and future.result(timeout=5)
        assert disk.contains(evicted) and not stack.lower.contains(evicted)
        publish(other, shared, block(2))                        # another node's block
        future = stack.find("ns", [shared.key])
        assert future is not None and future.result(timeout=5) == [shared.key]
        assert stack.contains(shared)
        assert sorted(stack.keys("ns")) == sorted([evicted.key, shared.key])
        assert promote(stack, evicted) == block(1)              # from the disk
        assert promote(stack, shared) == block(2)               # from the store
        future = stack.publish(evicted, memoryview(block(1)))  # stored: to the store
        assert future is not None and future.result(timeout=5)
        assert stack.lower.contains(evicted)                    # now both hold it
        disk.on_dropped([evicted])                              # the disk lets it go
        assert dropped == []                                    # the store still has it
        stack.lower.on_dropped([shared])
        assert dropped == [shared]
        assert stack.stats().capacity_bytes == disk.stats().capacity_bytes + (64 << 20)
    finally:
        disk.close()


def test_only_the_tenants_that_share_use_the_store(make_tier, store):
    """tiers.cluster.tenants: a tenant not named never publishes, and its engines never ask
    the store (their namespaces' tables do not say FLAG_ASK)."""
    a = make_tier("node-a", shares=lambda tenant: tenant == "shared")
    assert a.demote(TierKey("ns-private", b"k", "private"), memoryview(block(1))) is None
    publish(a, TierKey("ns-shared", b"k", "shared"), block(2))
    assert not any("ns-private" in name for name in store.values)
    b = make_tier("node-b", shares=lambda tenant: tenant == "shared")
    assert b.find_flags("private") == 0 and b.find_flags("shared") & FLAG_ASK
    assert find(b, "ns-shared", [b"k"]) == [b"k"]


def test_used_bytes_count_the_blocks_it_knows_at_their_size(make_tier, store):
    """`kvd_tier_used_bytes{tier="cluster"}` is blocks x block size (it said 0 while the tier
    knew 48 blocks): this node's from what it published, another node's from the size of
    the namespace its engines use (told when the namespace joins), before any promotion."""
    a, b = make_tier("node-a"), make_tier("node-b")
    b.join_namespace("ns", "t", BLOCK)
    keys = [TierKey("ns", bytes([i]) * 8, "t") for i in range(5)]
    for key in keys:
        publish(a, key, block(1))
    st = a.stats()
    assert (st.blocks, st.used_bytes) == (5, 5 * BLOCK)
    assert len(find(b, "ns", [k.key for k in keys])) == 5
    assert (b.stats().blocks, b.stats().used_bytes) == (5, 5 * BLOCK)
    assert a.remove_namespace("ns") == 5
    assert (a.stats().blocks, a.stats().used_bytes) == (0, 0)
