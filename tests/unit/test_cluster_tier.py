"""The cluster tier's logic over an in-memory store with Mooncake's semantics (names to bytes,
a master that may go down and come back empty): publication, the nodes' manifests, promotion
with its checksum, tenants apart, degradation and recovery. The real store runs in
tests/multiproc/test_cluster_tier.py."""

from __future__ import annotations

import threading
import time

import pytest

from kvd_server.tiers.base import TierHealth, TierKey
from kvd_server.tiers.cluster.names import (
    NODES,
    StoreFormatError,
    block_name,
    check_block,
    decode_manifest,
    decode_nodes,
    encode_block,
    encode_manifest,
    encode_nodes,
    manifest_name,
)
from kvd_server.tiers.cluster.store import TRANSFER_FAIL, StoreError
from kvd_server.tiers.cluster.tier import ClusterTier

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

    def client(self) -> MemoryStore:
        if self.down:
            raise StoreError("master unreachable")
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


def test_a_block_one_node_published_is_found_and_read_by_another(make_tier, store):
    a, b = make_tier("node-a"), make_tier("node-b")
    named: list[tuple[list[TierKey], bool]] = []
    b.on_named = lambda keys, found: named.append((keys, found))
    key = TierKey("ns1", b"k" * 40, "tenant")
    b.join_namespace("ns1", "tenant")               # b's engines use ns1: it watches it
    publish(a, key, block(7))
    assert a.contains(key) and store.get(block_name("ns1", key.key)) is not None
    wait(lambda: b.contains(key), "node b to find the block through a's manifest")
    assert any(found and key.key in [k.key for k in keys] for keys, found in named)
    assert promote(b, key) == block(7)
    st = b.stats()
    assert st.promotions_total == 1 and st.hits_total == 1 and st.health == TierHealth.OK
    assert sorted(decode_nodes(store.values[NODES])) == ["node-a", "node-b"]
    assert decode_manifest(store.values[manifest_name("ns1", "node-a")]) == [key.key]


def test_another_namespace_never_sees_the_block(make_tier):
    """Namespaces are digests of tenant, model and layout: another tenant's engines (another
    namespace) find nothing, on any node."""
    a, b = make_tier("node-a"), make_tier("node-b")
    b.join_namespace("other-tenant-ns", "t2")
    key = TierKey("ns1", b"shared-prefix", "t1")
    publish(a, key, block(1))
    time.sleep(0.2)                                 # several syncs
    other = TierKey("other-tenant-ns", key.key, "t2")
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
    b.join_namespace("ns", "")
    key = TierKey("ns", b"before")
    publish(a, key, block(5))
    wait(lambda: b.contains(key), "b to find the block")
    store.down = True
    wait(lambda: b.stats().health == TierHealth.DEGRADED, "b to degrade")
    assert not b.readable and promote(b, key) is None
    assert b.demote(TierKey("ns", b"refused"), memoryview(block(6))) is None
    store.restart()                                  # back, empty
    wait(lambda: a.readable and b.readable, "both to recover")
    wait(lambda: not b.contains(key), "b to forget what the master lost")
    assert promote(b, key) is None                   # never served from memory of it
    after = TierKey("ns", b"after")
    publish(a, after, block(9))
    wait(lambda: b.contains(after), "b to find a block published after the restart")
    assert promote(b, after) == block(9)


def test_a_put_failing_for_its_replica_alone_never_degrades_the_tier(make_tier, store):
    """A node that died without leaving: puts placed on its segment fail (TRANSFER_FAIL)
    until the master drops it. That block is not published (counted as a failure), the
    tier serves on, and a manifest that failed so is written at the next sync."""
    a, b = make_tier("node-a"), make_tier("node-b")
    b.join_namespace("ns", "")
    store.lost_puts = 1
    lost = a.demote(TierKey("ns", b"lost"), memoryview(block(1)))
    assert lost is not None and lost.result(timeout=5) is False
    assert a.stats().health == TierHealth.OK and a.stats().failures_total == 1
    key = TierKey("ns", b"kept")
    publish(a, key, block(2))
    store.lost_puts = 3                    # the manifest's writes fail for a while too
    wait(lambda: b.contains(key), "b to find the block once a's manifest is written")
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


@pytest.mark.parametrize("value", [b"", b"KVDM\x02\x00\x00\x00\x01a",
                                   b"KVDM\x01\x00\x00\x00\x05abc", b"KVDM\xff\xff\xff\xff",
                                   encode_manifest([b"a"]) + b"tail"])
def test_a_manifest_that_is_not_one_is_refused(value):
    with pytest.raises(StoreFormatError):
        decode_manifest(value)


def test_lists_round_trip():
    keys = [bytes([i]) * (1 + i % 40) for i in range(100)]
    assert decode_manifest(encode_manifest(keys)) == keys
    assert decode_nodes(encode_nodes(["a", "b-é"])) == ["a", "b-é"]


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
        wait(lambda: stack.contains(shared), "the stack to know the other node's block")
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
    """tiers.cluster.tenants: a tenant not named never publishes, and its namespaces never
    read the other nodes' blocks."""
    a = make_tier("node-a", shares=lambda tenant: tenant == "shared")
    assert a.demote(TierKey("ns-private", b"k", "private"), memoryview(block(1))) is None
    publish(a, TierKey("ns-shared", b"k", "shared"), block(2))
    assert not any("ns-private" in name for name in store.values)
    b = make_tier("node-b", shares=lambda tenant: tenant == "shared")
    b.join_namespace("ns-shared", "shared")
    b.join_namespace("ns-private", "private")
    publish(make_tier("node-c"), TierKey("ns-private", b"p", "private"), block(3))
    wait(lambda: b.contains(TierKey("ns-shared", b"k")), "b to find the shared block")
    time.sleep(0.2)
    assert not b.contains(TierKey("ns-private", b"p"))


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
    wait(lambda: b.stats().blocks == 5, "b to learn a's blocks")
    assert b.stats().used_bytes == 5 * BLOCK
    assert a.remove_namespace("ns") == 5
    assert (a.stats().blocks, a.stats().used_bytes) == (0, 0)
