"""Warm restart's pure parts: the index check (what may be served of an index a previous daemon
left, kvd_server/restart/adopt.py), the manager and policies taking over READY blocks, the
namespace's slots taking over an extent, the state record (kvd_server/restart/state.py) and
the engine releasing an earlier session with nothing in flight (kvd_client/offload/old_copies.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from kvd_client.offload.old_copies import OldCopies
from kvd_proto.index_layout import STATE_FREE
from kvd_proto.wire import KvLayout
from kvd_server.core.peer import process_start, same_process
from kvd_server.manager import NamespaceManager
from kvd_server.memory.extents import ExtentAllocator, NamespaceSlots
from kvd_server.memory.shm_index import Reclamation, ShmIndex
from kvd_server.restart.adopt import check_index
from kvd_server.restart.state import Manifest, NamespaceRecord, SessionRecord, StateDir

CAP = 64


def index_with(ready: dict[int, bytes], storing: dict[int, bytes] = {}) -> ShmIndex:  # noqa: B006
    idx = ShmIndex(CAP, 16, CAP, 1, CAP, private=True)
    for slot, key in {**ready, **storing}.items():
        assert idx.insert(slot, key)
    for slot in ready:
        idx.set_ready(slot)
    return idx


def key(i: int) -> bytes:
    return f"key-{i:04d}".encode()


def test_ready_blocks_are_kept_and_interrupted_stores_dropped():
    idx = index_with({1: key(1), 5: key(5), 9: key(9)}, storing={3: key(3)})
    check = check_index(idx)
    assert check.ready.tolist() == [1, 5, 9]
    assert dict(check.dropped) == {"being stored": 1} and not check.rebuilt
    assert idx.find(key(3)) == -1 and idx.state(3) == STATE_FREE
    assert [idx.find(key(i)) for i in (1, 5, 9)] == [1, 5, 9]


def test_a_key_held_twice_is_served_from_the_slot_a_lookup_finds():
    idx = index_with({1: key(1), 2: key(7)})
    # A move the crash interrupted: slot 4 holds key 7 too, READY, with its own bucket.
    assert idx.insert(4, key(7))
    idx.set_ready(4)
    check = check_index(idx)
    assert check.ready.tolist() == [1, 2]
    assert check.dropped["not found under its key"] == 1 and check.rebuilt
    assert idx.find(key(7)) == 2 and idx.find(key(1)) == 1
    assert idx.state(4) == STATE_FREE


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
def test_reachable_is_the_same_compiled_and_in_python(native):
    from kvd_proto import native as kn

    if native and not kn.NATIVE:
        pytest.skip("kvd_proto._native not built")
    idx = index_with({1: key(1), 3: key(3), 5: key(5)})
    table = kn.PyIndexTable(idx._map, *idx.header.geometry) if not native else idx._table
    idx.keys_array()[5, 0] ^= 0xFF
    slots = np.array([1, 3, 5, 7, -1, CAP + 3], dtype=np.int64)
    found = table.reachable(slots.tobytes())
    assert list(found) == [1, 1, 0, 0, 0, 0]


def test_a_ready_slot_no_bucket_names_and_a_bucket_naming_a_free_slot_are_repaired():
    idx = index_with({1: key(1), 2: key(2), 3: key(3)})
    buckets = idx.buckets_array()
    named_2 = int(np.flatnonzero(buckets == 3)[0])
    buckets[named_2] = 0                          # slot 2: READY, but no bucket names it
    spare = int(np.flatnonzero(buckets == 0)[0])
    buckets[spare] = 11                            # a bucket naming free slot 10
    check = check_index(idx)
    assert check.ready.tolist() == [1, 3] and check.rebuilt
    assert check.dropped["not found by its bucket"] == 1
    assert set(np.flatnonzero(idx.buckets_array()).tolist()) and \
        sorted(v - 1 for v in idx.buckets_array() if v) == [1, 3]
    assert idx.find(key(1)) == 1 and idx.find(key(3)) == 3 and idx.find(key(2)) == -1


def test_a_key_changed_under_the_index_is_not_served_under_its_new_name():
    idx = index_with({1: key(1), 2: key(2)})
    keys = idx.keys_array()
    keys[2, 0] ^= 0xFF                             # the bytes no longer hash to its bucket
    check = check_index(idx)
    assert check.ready.tolist() == [1]
    assert check.dropped["not found under its key"] == 1


def test_a_key_length_out_of_range_is_dropped():
    idx = index_with({1: key(1), 2: key(2)})
    meta = idx.meta_array()
    meta[2] = (meta[2] & ~np.uint64(0xFF << 2)) | np.uint64(200 << 2)   # wider than 16
    check = check_index(idx)
    assert check.ready.tolist() == [1] and check.dropped["key length out of range"] == 1


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_manager_takes_over_ready_blocks_and_evicts_them_oldest_first(policy):
    extents = ExtentAllocator(CAP * 4096, 16 * 4096)
    slots = NamespaceSlots(extents, 4096)
    idx = ShmIndex(extents.total * slots.per_extent, 16, slots.per_extent, slots.stride,
                   extents.extent_bytes, private=True)
    ready = {s: key(s) for s in (0, 3, 5, 17, 18)}
    for s, k in ready.items():
        idx.insert(s, k)
        idx.set_ready(s)
    idx.reset_epoch = 7
    slots.limbo = Reclamation(idx)
    mgr = NamespaceManager(slots, policy, index=idx)
    check = check_index(idx)
    for extent in (0, 1):
        mine = [s for s in check.ready.tolist() if s // slots.per_extent == extent]
        base = extent * slots.per_extent
        idle = [s for s in range(base, base + slots.per_extent) if s not in mine]
        assert slots.adopt_extent(extent, len(mine), idle)
    mgr.adopt(check.ready)
    assert mgr.epoch == 7 and len(mgr) == 5 and mgr.counts().ready == 5
    assert extents.free_extents() == extents.total - 2 and slots.extents_held() == 2
    # Nobody reads: the idle slots came back at once; a store takes never-held ones later.
    assert slots.free_count() == slots.capacity() - 5
    # Adopted in slot order, so the policy evicts the lowest slots first.
    victims = mgr.policy.evict(2, set())
    assert [k for k, _ in victims] == [key(0), key(3)]


def test_idle_slots_of_an_adopted_extent_wait_for_the_readers_of_the_previous_daemon():
    extents = ExtentAllocator(CAP * 4096, 16 * 4096)
    slots = NamespaceSlots(extents, 4096)
    idx = ShmIndex(extents.total * slots.per_extent, 16, slots.per_extent, slots.stride,
                   extents.extent_bytes, private=True)
    reclaim = slots.limbo = Reclamation(idx)
    reclaim.hold("old-session", os.getpid(), idx.reclaim_epoch)
    assert slots.adopt_extent(0, 1, list(range(1, 16)))
    assert slots.free_count() == slots.capacity() - 16      # held: none of them back yet
    assert reclaim.release_reader("old-session")
    assert slots.free_count() == slots.capacity() - 1


def test_the_state_record_round_trips_and_says_what_it_cannot_serve(tmp_path: Path):
    d = StateDir(str(tmp_path / "state"))
    d.prepare()
    assert d.read() is None
    layout = KvLayout(4096, 2, 2048, 16, "bfloat16", 40)
    m = Manifest(pool_size=1 << 20, extent_bytes=1 << 16, tenants={"default": "abc"})
    m.namespaces["n1"] = NamespaceRecord.of("n1", "model", layout, "salt", "default")
    d.write(m)
    back = d.read()
    assert back is not None and back.namespaces["n1"].layout == layout
    assert back.tenants == {"default": "abc"} and back.written_at > 0
    assert back.unservable(1 << 20, 1 << 16) is None
    assert "pool.size changed" in back.unservable(2 << 20, 1 << 16)
    assert "pool.extent_size changed" in back.unservable(1 << 20, 1 << 17)
    doc = json.loads(m.to_json())
    doc["state_version"] = 99
    (tmp_path / "state" / "state.json").write_text(json.dumps(doc))
    assert "version 99" in d.read().unservable(1 << 20, 1 << 16)
    (tmp_path / "state" / "state.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a kvd state record"):
        d.read()


def test_session_records_and_a_cold_start_clear(tmp_path: Path):
    d = StateDir(str(tmp_path))
    d.prepare()
    me = SessionRecord("s1", "n1", os.getpid(), process_start(os.getpid()), os.getuid())
    d.record_session(me)
    (tmp_path / "sessions" / "torn").write_bytes(b"{\"sess")      # died mid-write
    assert d.old_sessions() == [me]
    assert same_process(me.pid, me.start) and not same_process(me.pid, me.start + 1)
    for name in ("pool", "pool.abc", "index-n1", "state.json", "unrelated"):
        (tmp_path / name).write_bytes(b"x")
    assert d.clear() == 4
    assert sorted(os.listdir(tmp_path)) == ["lock", "sessions", "unrelated"]
    assert d.old_sessions() == []


def test_a_directory_of_another_uid_is_refused(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory of another uid")
    other = tmp_path / "theirs"
    other.mkdir()
    os.chown(other, 4242, 4242)
    with pytest.raises(Exception, match="belongs to uid 4242"):
        StateDir(str(other)).prepare()


def test_an_earlier_session_with_nothing_in_flight_is_released_at_once():
    old = OldCopies()
    assert old.add("s1", 0) == ["s1"]
    assert old.add("s2", 2) == []
    assert old.add("s3", 0) == []           # s2's copies still run: released together
    assert old.finished(1) == []
    assert old.finished(1) == ["s2", "s3"]
    assert old.add(None, 3) == []


def test_lru_ranks_that_outlived_the_daemon_keep_the_eviction_order():
    """The previous daemon's ranks (in memory that outlived it) decide the order: the block it
    used least recently goes first, whatever its slot; a block with no rank ranks after them."""
    import mmap

    from kvd_server.manager.blocks import BlockTable
    from kvd_server.manager.policies import make_policy

    idx = index_with({1: key(1), 2: key(2), 3: key(3), 4: key(4)})
    memory = mmap.mmap(-1, 8 * CAP)
    ranks = np.frombuffer(memory, dtype=np.int64, count=CAP)
    for slot, order in ((1, 30), (2, 10), (3, 20)):              # slot 4: never ranked
        ranks[slot] = (order << 24) | ((1 << 24) - 1)
    table = BlockTable(idx, CAP)
    lru = make_policy("lru", CAP, table, memory)
    ready = np.array([1, 2, 3, 4])
    table.adopt(ready)
    lru.adopt(ready)
    assert lru._next_rank == 31                  # new ranks come after the kept ones
    assert [k for k, _ in lru.evict(4, set())] == [key(2), key(3), key(1), key(4)]
