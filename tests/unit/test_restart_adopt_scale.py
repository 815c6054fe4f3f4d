"""Adopting a pool costs what it holds, not its size: an index is sized for the whole pool (a
64 GiB pool of 4 KiB blocks is 16M slots) and is a sparse memory file, so the checks read only
the pages that were written (and allocate none of the others in the tmpfs), and an adopted
extent's idle slots travel through limbo and the free slots as one array, never a Python
object per slot. Counts, not timings (bench/restart.py times a warm restart)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvd_proto.index_layout import key_hash
from kvd_proto.wire import KvLayout
from kvd_server.config import DEFAULT_TENANT, load_config
from kvd_server.core.core import KvdCore
from kvd_server.core.namespaces import namespace_id
from kvd_server.memory.extents import ExtentAllocator, NamespaceSlots
from kvd_server.memory.shm_index import Reclamation, ShmIndex
from kvd_server.memory.tenant_pools import TenantPools
from kvd_server.restart.adopt import check_index
from kvd_server.restart.state import Manifest, NamespaceRecord, StateDir
from kvd_server.restart.warm import WarmRestart

SHM = Path("/dev/shm")
SLOT = 4096
EXTENT = 64 << 20
PER = EXTENT // SLOT                  # 16,384 slots of 4 KiB per extent of 64 MiB
EXTENTS = 128                         # 8 GiB: 2M slots
WIDTH = 16


def key(i: int) -> bytes:
    return f"key-{i:010d}".encode()[:WIDTH]


@pytest.fixture
def index_path(tmp_path: Path) -> Iterator[Path]:
    if not SHM.is_dir():
        pytest.skip("no /dev/shm: the index must be a tmpfs file")
    path = SHM / f"kvd-adopt-scale-{os.getpid()}-{tmp_path.name}"
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    if not SHM.is_dir():
        pytest.skip("no /dev/shm: warm restart's files live in memory")
    path = SHM / f"kvd-adopt-scale-state-{os.getpid()}-{tmp_path.name}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def big_index(path: Path | None, ready: list[int], storing: list[int] = ()) -> ShmIndex:
    """An index of EXTENTS x PER slots (a file at `path`, else anonymous memory) holding
    `ready` and `storing` slots."""
    idx = ShmIndex(EXTENTS * PER, WIDTH, PER, SLOT, EXTENT, private=path is None,
                   path=None if path is None else str(path))
    for slot in [*ready, *storing]:
        assert idx.insert(slot, key(slot))
    for slot in ready:
        idx.set_ready(slot)
    return idx


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_checking_a_large_index_with_few_blocks_reads_and_allocates_only_their_pages(
        index_path: Path):
    ready = [e * PER + i * 1000 for e in range(0, EXTENTS, 8) for i in range(4)]   # 64 blocks
    idx = big_index(index_path, ready, storing=[5 * PER + 7])
    before = allocated(index_path)
    check = check_index(idx)
    assert check.ready.tolist() == ready and dict(check.dropped) == {"being stored": 1}
    # Every slot and bucket read, and so allocated, would be 8 + 8 bytes per slot: 32 MiB.
    grown = allocated(index_path) - before
    assert grown <= 4 * 4096, f"checking the index allocated {grown} bytes of its holes"
    words = idx.header.capacity + idx.header.buckets
    assert check.words_read <= 64 * 3 * 1024, \
        f"read {check.words_read} of the index's {words} meta words and buckets"
    idx.close()


def _corrupt(idx: ShmIndex, how: str) -> None:
    """What a daemon killed in the middle of a write leaves (test_restart_adopt.py has each
    case alone, on a small index)."""
    buckets, meta = idx.buckets_array(), idx.meta_array()
    if how == "twin key":                         # a move interrupted: two READY slots, one key
        twin = 3 * PER + 11
        assert idx.insert(twin, key(2 * PER + 5))
        idx.set_ready(twin)
    elif how == "bucket naming a free slot":
        assert buckets[12345] == 0
        buckets[12345] = 40 * PER + 2 + 1         # slot + 1: 0 is an empty bucket
    elif how == "unnamed ready slot":
        buckets[_bucket_of(idx, 2 * PER + 5)] = 0
    elif how == "key length out of range":
        slot = 9 * PER + 1000
        meta[slot] = (meta[slot] & ~np.uint64(0xFF << 2)) | np.uint64(200 << 2)


def _bucket_of(idx: ShmIndex, slot: int) -> int:
    """The bucket naming `slot` (linear probing from its key's hash), reading only the
    buckets on the way."""
    buckets, n = idx.buckets_array(), idx.header.buckets
    at = key_hash(idx.key_of(slot)) & (n - 1)
    while buckets[at] != slot + 1:
        at = (at + 1) & (n - 1)
    return at


@pytest.mark.parametrize("how", ["none", "twin key", "bucket naming a free slot",
                                 "unnamed ready slot", "key length out of range"])
def test_reading_only_the_pages_held_answers_as_reading_every_word(index_path: Path, how: str):
    ready = [2 * PER + 5, 9 * PER + 1000, 9 * PER + 1001, 77 * PER + PER - 1]
    sparse = big_index(index_path, ready, storing=[100 * PER])
    _corrupt(sparse, how)
    # The same bytes in anonymous memory (read with pread: the file's holes stay holes).
    whole = big_index(None, [])
    whole._map[:] = os.pread(sparse.fd, sparse.header.file_bytes, 0)
    a, b = check_index(sparse), check_index(whole)
    assert a.ready.tolist() == b.ready.tolist() and a.dropped == b.dropped
    assert a.rebuilt == b.rebuilt
    assert a.words_read * 100 < b.words_read
    assert np.array_equal(sparse.meta_array(), whole.meta_array())
    assert np.array_equal(sparse.buckets_array(), whole.buckets_array())
    sparse.close()
    whole.close()


def _adopted(idle: Callable[[int], list[int] | np.ndarray], extents: int = 32,
             held: bool = True) -> tuple[NamespaceSlots, Reclamation]:
    """A namespace's slots over a private index, every one of `extents` extents adopted with
    one READY block (its slot 0) and the rest idle, a reader of the previous daemon holding."""
    pool = ExtentAllocator(EXTENTS * EXTENT, EXTENT)
    slots = NamespaceSlots(pool, SLOT)
    idx = ShmIndex(EXTENTS * PER, WIDTH, PER, SLOT, EXTENT, private=True)
    limbo = slots.limbo = Reclamation(idx)
    if held:
        limbo.hold("old-session", os.getpid(), idx.reclaim_epoch)
    for extent in range(extents):
        assert slots.adopt_extent(extent, 1, idle(extent))
    return slots, limbo


def _as_array(extent: int) -> np.ndarray:
    return np.arange(extent * PER + 1, (extent + 1) * PER, dtype=np.int64)


def _as_list(extent: int) -> list[int]:
    return list(range(extent * PER + 1, (extent + 1) * PER))


def test_adopted_idle_slots_make_no_python_object_each():
    blocks = sys.getallocatedblocks()
    slots, limbo = _adopted(_as_array)
    assert slots.free_count() == slots.capacity() - 32 * PER      # held: none back yet
    assert limbo.in_limbo == 32 * (PER - 1) and slots.retired_in(7) == PER - 1
    assert limbo.release_reader("old-session")
    assert slots.free_count() == slots.capacity() - 32 and limbo.in_limbo == 0
    assert slots.retired_in(7) == 0
    # 32 extents of 16,383 idle slots each: a Python int per slot would be 524,256 blocks.
    grown = sys.getallocatedblocks() - blocks
    assert grown < 20_000, f"{grown} Python objects for {32 * (PER - 1)} idle slots"


def test_adopted_idle_slots_come_back_in_the_order_a_list_of_them_would():
    runs, _ = _adopted(_as_array, extents=3, held=False)
    lists, _ = _adopted(_as_list, extents=3, held=False)
    for s in (runs, lists):
        s.collect()
        s.free(2 * PER)                             # freed after: handed out first
    for n in (1, 5000, 3, PER, 17):
        assert runs.allocate(n) == lists.allocate(n)
    # An extent drained meanwhile: none of its slots is handed out again, either way.
    assert not runs.drain(0) and not lists.drain(0)
    assert runs.allocate(9000) == lists.allocate(9000)
    assert runs.free_count() == lists.free_count() and runs.capacity() == lists.capacity()


def _lay_out(state: Path, ready: list[int]) -> Path:
    """A warm-restart directory as a daemon leaves it: an 8 GiB pool of 4 KiB blocks (a
    sparse file), one namespace whose index holds `ready`. Its index file."""
    layout = KvLayout(SLOT, 1, SLOT, 16, "bfloat16", WIDTH)
    ns_id = namespace_id("scale", layout, "", DEFAULT_TENANT)
    keeper = StateDir(str(state))
    keeper.prepare()
    index = big_index(keeper.index_path(ns_id), ready)
    index.close()
    with open(keeper.pool_path(DEFAULT_TENANT), "wb") as f:
        f.truncate(EXTENTS * EXTENT)
    manifest = Manifest(pool_size=EXTENTS * EXTENT, extent_bytes=EXTENT,
                        tenants={DEFAULT_TENANT: "c" * 16})
    manifest.namespaces[ns_id] = NamespaceRecord.of(ns_id, "scale", layout, "", DEFAULT_TENANT)
    keeper.write(manifest)
    keeper.release()
    return keeper.index_path(ns_id)


def test_a_warm_restart_adopts_a_large_pool_of_few_blocks_without_an_object_per_slot(
        state_dir: Path):
    ready = [e * PER + i * 4000 for e in range(EXTENTS) for i in range(2)]     # 256 blocks
    index_file = _lay_out(state_dir, ready)
    cfg = load_config(None, env={}, overrides={
        "pool.size": (str(EXTENTS * EXTENT), "test"), "pool.extent_size": ("64MiB", "test"),
        "restart.warm": (True, "test"), "restart.directory": (str(state_dir), "test")})
    # What the daemon does at start (kvd_server/server.py), up to its first sweep.
    warm = WarmRestart.open(cfg, cfg.pool.size)
    assert warm is not None and warm.adopting
    pools = TenantPools(cfg.pool, warm)
    for tenant in warm.tenants_to_adopt():
        pools.for_tenant(tenant)
    extents = ExtentAllocator(cfg.pool.size, cfg.pool.extent_size, first_owner=DEFAULT_TENANT,
                              on_move=pools.relocate)
    pools.extent_bytes = extents.extent_bytes
    core = KvdCore(cfg, extents)
    core.warm = warm
    core.namespaces.files = warm
    index_bytes = allocated(index_file)
    blocks = sys.getallocatedblocks()
    try:
        warm.adopt(core)
        core.sweep()                          # the idle slots come back out of limbo
        grown = sys.getallocatedblocks() - blocks
        assert warm.stats.blocks_adopted == len(ready)
        (ns,) = list(core.namespaces)
        assert ns.slots.free_count() == EXTENTS * PER - len(ready)
        # 2M slots, 256 blocks: an object per idle slot would be 2M Python objects, and
        # reading every meta word and bucket would allocate 32 MiB of the index's holes.
        assert grown < 20_000, f"{grown} Python objects to adopt {len(ready)} blocks"
        assert allocated(index_file) - index_bytes <= 16 * 4096
    finally:
        pools.close()
        warm.dir.release()
