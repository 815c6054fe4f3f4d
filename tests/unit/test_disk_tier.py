"""The disk tier on real files: byte-exact round trips past its capacity, LRU eviction,
checksums, its journal across a restart, tenants and quotas, and degrading on bad disks."""

from __future__ import annotations

import os
import shutil
import struct
import time
import zlib

import pytest

from kvd_server.tiers import TierHealth, TierKey
from kvd_server.tiers.disk.journal import Journal, Placed
from kvd_server.tiers.disk.space import DiskSpace
from kvd_server.tiers.disk.tier import DATA_FILE, JOURNAL_FILE, DiskTier

BLOCK = 64 << 10
EXTENT = 256 << 10
SIZE = 1 << 20                    # 16 blocks of 64 KiB
NS = "ns-a"


def block(i: int, n: int = BLOCK) -> bytes:
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


def key(i: int, ns: str = NS, tenant: str = "") -> TierKey:
    return TierKey(ns, f"key-{i}".encode(), tenant)


def demote_all(tier: DiskTier, keys: list[TierKey], size: int = BLOCK) -> None:
    for k in keys:
        future = tier.demote(k, block(int(k.key[4:]), size))
        assert future is not None, k
        assert future.result(timeout=10)


def read(tier: DiskTier, k: TierKey, n: int = BLOCK) -> bytes | None:
    dest = bytearray(n)
    future = tier.promote(k, memoryview(dest))
    if future is None or not future.result(timeout=10):
        return None
    return bytes(dest)


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(str(tmp_path / "disk"), SIZE, extent_bytes=EXTENT, io_threads=2)
    yield t
    t.close()


def test_more_than_it_holds_comes_back_byte_exact_newest_first(tier):
    keys = [key(i) for i in range(40)]
    demote_all(tier, keys)
    held = [k for k in keys if tier.contains(k)]
    assert held == keys[-16:]                      # LRU: the newest 16 of 40
    for k in held:
        assert read(tier, k) == block(int(k.key[4:]))
    assert read(tier, keys[0]) is None
    st = tier.stats()
    assert (st.blocks, st.used_bytes, st.demotions_total) == (16, SIZE, 40)
    assert st.evictions_total == 24 and st.promotions_total == 16 and st.misses_total == 1
    assert st.health is TierHealth.OK and st.queue_depth == 0


def test_a_promotion_keeps_a_block_recent(tier):
    keys = [key(i) for i in range(16)]
    demote_all(tier, keys)
    assert read(tier, keys[0]) == block(0)         # now the most recent
    demote_all(tier, [key(100)])
    assert tier.contains(keys[0]) and not tier.contains(keys[1])


def test_blocks_survive_a_restart(tmp_path):
    directory = str(tmp_path / "disk")
    t = DiskTier(directory, SIZE, extent_bytes=EXTENT)
    demote_all(t, [key(i) for i in range(10)])
    t.remove(key(3))
    t.close()
    again = DiskTier(directory, SIZE, extent_bytes=EXTENT)
    try:
        assert again.stats().blocks == 9
        assert not again.contains(key(3))
        for i in (0, 1, 2, 4, 9):
            assert read(again, key(i)) == block(i)
        demote_all(again, [key(50)])               # and it goes on from there
        assert read(again, key(50)) == block(50)
    finally:
        again.close()


def test_a_corrupt_block_is_dropped_not_served(tier):
    demote_all(tier, [key(1), key(2)])
    entry = tier._space.get(key(1))
    with open(os.path.join(tier.directory, DATA_FILE), "r+b") as f:
        f.seek(entry.offset + 100)
        f.write(b"\xff\xfe")
    assert read(tier, key(1)) is None
    assert not tier.contains(key(1))
    assert read(tier, key(2)) == block(2)
    assert tier.stats().corrupt_total == 1


def test_a_torn_journal_tail_loses_only_the_torn_record(tmp_path):
    directory = str(tmp_path / "disk")
    t = DiskTier(directory, SIZE, extent_bytes=EXTENT)
    demote_all(t, [key(i) for i in range(5)])
    t.close()
    path = os.path.join(directory, JOURNAL_FILE)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 7)     # the last PUT cut short
    again = DiskTier(directory, SIZE, extent_bytes=EXTENT)
    try:
        assert [again.contains(key(i)) for i in range(5)] == [True] * 4 + [False]
        assert read(again, key(3)) == block(3)
    finally:
        again.close()


def test_another_layout_starts_empty(tmp_path, caplog):
    directory = str(tmp_path / "disk")
    t = DiskTier(directory, SIZE, extent_bytes=EXTENT)
    demote_all(t, [key(1)])
    t.close()
    again = DiskTier(directory, 2 * SIZE, extent_bytes=EXTENT)
    try:
        assert again.stats().blocks == 0 and not again.contains(key(1))
        assert "starting empty" in caplog.text
    finally:
        again.close()


def test_tenants_are_kept_apart_and_within_their_quota(tmp_path):
    quotas = {"small": 2 * BLOCK}
    t = DiskTier(str(tmp_path / "disk"), SIZE, extent_bytes=EXTENT,
                 quota_of=lambda tenant: quotas.get(tenant, 0))
    try:
        a = [key(i, "ns-small", "small") for i in range(5)]
        b = [key(i, "ns-big", "big") for i in range(5)]
        demote_all(t, a + b)
        assert [t.contains(k) for k in a] == [False, False, False, True, True]
        assert all(t.contains(k) for k in b)
        assert t.stats().by_tenant_bytes == {"small": 2 * BLOCK, "big": 5 * BLOCK}
        # the same key in another namespace is another block
        assert read(t, key(4, "ns-small", "small")) == block(4)
        assert t.promote(key(4, "ns-other", "small"), memoryview(bytearray(BLOCK))) is None
    finally:
        t.close()


def test_block_sizes_share_the_file(tier):
    small = [key(i) for i in range(8)]
    for k in small:
        assert tier.demote(k, block(int(k.key[4:]), 4096)).result(timeout=10)
    large = [key(100 + i) for i in range(16)]
    demote_all(tier, large)                       # takes the small blocks' extent back
    assert all(tier.contains(k) for k in large[-12:])
    for k in large[-12:]:
        assert read(tier, k) == block(int(k.key[4:]))


def test_remove_namespace_drops_only_it(tier):
    demote_all(tier, [key(1, "x"), key(2, "x"), key(3, "y")])
    assert tier.remove_namespace("x") == 2
    assert not tier.contains(key(1, "x")) and tier.contains(key(3, "y"))


def test_a_full_queue_refuses_instead_of_waiting(tmp_path):
    t = DiskTier(str(tmp_path / "disk"), SIZE, extent_bytes=EXTENT, queue_bytes=BLOCK)
    try:
        futures = [t.demote(key(i), block(i)) for i in range(50)]
        accepted = [f for f in futures if f is not None]
        assert accepted and len(accepted) < 50
        assert all(f.result(timeout=10) for f in accepted)
        assert t.stats().demotions_refused_total == 50 - len(accepted)
    finally:
        t.close()


def test_an_unusable_directory_degrades_the_tier(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    t = DiskTier(str(blocker / "disk"), SIZE, extent_bytes=EXTENT)
    try:
        assert t.demote(key(1), block(1)) is None
        st = t.stats()
        assert st.health is TierHealth.DEGRADED and "Not a directory" in st.reason
        assert st.demotions_refused_total == 1
        assert t.promote(key(1), memoryview(bytearray(BLOCK))) is None
    finally:
        t.close()


def test_a_disk_too_small_for_the_tier_degrades_it(tmp_path):
    huge = 1 << 50                                 # a PiB: no test machine has it free
    t = DiskTier(str(tmp_path / "disk"), huge, extent_bytes=1 << 30)
    try:
        st = t.stats()
        assert st.health is TierHealth.DEGRADED, st
        assert st.reason.startswith("filesystem too small for tiers.disk.size: "), st
        assert st.reason.endswith("in all, tiers.disk.size is 1024TiB"), st
        assert t.demote(key(1), block(1)) is None
    finally:
        t.close()


def test_a_second_daemon_cannot_share_the_directory(tier, tmp_path):
    other = DiskTier(tier.directory, SIZE, extent_bytes=EXTENT)
    try:
        assert other.stats().health is TierHealth.DEGRADED
        assert other.stats().reason == \
            f"another kvd daemon (pid {os.getpid()}) uses {tier.directory}"
    finally:
        other.close()


def test_space_bookkeeping_frees_extents():
    space = DiskSpace(SIZE, EXTENT)
    entries = [space.allocate(key(i), BLOCK)[0] for i in range(16)]
    for i, e in enumerate(entries):
        space.ready(e, i)
    assert space.allocate(key(99), 3 * EXTENT)[0] is None       # larger than an extent
    for e in entries[:4]:
        space.release(e)
    assert space.used_bytes == 12 * BLOCK
    small, evicted = space.allocate(key(200), 4096)
    assert small is not None and evicted == []                  # the freed extent, reshaped


def test_a_tier_opened_in_the_background_refuses_until_open(tmp_path):
    t = DiskTier(str(tmp_path / "disk"), SIZE, extent_bytes=EXTENT, open_now=False)
    try:
        for _ in range(500):                    # the tier's own thread opens the files
            if t.stats().health == TierHealth.OK:
                break
            assert t.demote(key(0), block(0)) is None
            time.sleep(0.01)
        assert t.stats().health == TierHealth.OK
        demote_all(t, [key(1)])
        assert read(t, key(1)) == block(1)
    finally:
        t.close()


def test_promotion_reads_straight_into_an_aligned_slot_and_checks_it_there(tier):
    """A pool slot (page-aligned, at least the block's aligned length) is read into directly;
    an unaligned or short destination goes through a buffer; both byte-exact, and a corrupt
    block is refused either way. Buffers are reused, and their padding never carries another
    block's bytes to the disk."""
    import mmap

    odd = 5000                                        # padded to 8 KiB on the disk
    keys = [key(i) for i in range(1, 5)]
    demote_all(tier, keys, odd)
    slot = mmap.mmap(-1, 8192)                        # page-aligned, the whole padded length
    for k in keys:
        view = memoryview(slot)
        future = tier.promote(k, view)
        assert future is not None and future.result(timeout=10)
        assert slot[:odd] == block(int(k.key[4:]), odd)
        view.release()
        assert read(tier, k, odd + 1)[:odd] == block(int(k.key[4:]), odd)   # via a buffer
    entry = tier._space.get(keys[0])
    with open(os.path.join(tier.directory, DATA_FILE), "rb") as f:
        f.seek(entry.offset)
        assert f.read(8192)[odd:] == bytes(8192 - odd)          # zero padding on disk
    with open(os.path.join(tier.directory, DATA_FILE), "r+b") as f:
        f.seek(entry.offset + 10)
        f.write(b"\x00\xff")
    view = memoryview(slot)
    future = tier.promote(keys[0], view)
    assert future is not None and not future.result(timeout=10)
    view.release()
    assert not tier.contains(keys[0]) and tier.stats().corrupt_total == 1


def test_a_backlog_is_written_and_read_in_batches_byte_exact(tier):
    """Many demotions and promotions at once (more than the threads: they go in batches,
    kvd_server/tiers/disk/io_batches.py) each come back whole and in its own slot."""
    keys = [key(i) for i in range(16)]
    futures = [tier.demote(k, block(i)) for i, k in enumerate(keys)]
    assert all(f is not None and f.result(timeout=10) for f in futures)
    dests = [bytearray(BLOCK) for _ in keys]
    reads = [tier.promote(k, memoryview(d)) for k, d in zip(keys, dests)]
    assert all(f is not None and f.result(timeout=10) for f in reads)
    assert [bytes(d) for d in dests] == [block(i) for i in range(16)]
    st = tier.stats()
    assert (st.demotions_total, st.promotions_total, st.queue_depth) == (16, 16, 0)


def test_a_batch_that_fails_outside_the_disk_ends_every_promotion(tmp_path, monkeypatch):
    """No memory for a read buffer (or a bug): each promotion of the batch ends as failed (an
    I/O error: the tier degrades), nothing is left counted in flight, and once it retries the
    tier reads again."""
    tier = DiskTier(str(tmp_path / "disk"), SIZE, extent_bytes=EXTENT, io_threads=2,
                    retry_s=0.0)
    try:
        keys = [key(i) for i in range(3)]
        demote_all(tier, keys)

        def no_memory(size: int):
            raise MemoryError("no buffer")

        monkeypatch.setattr(tier._buffers, "take", no_memory)
        # not page-aligned: read through a buffer, which cannot be had
        futures = [tier.promote(k, memoryview(bytearray(BLOCK + 1))[1:]) for k in keys]
        assert [f.result(timeout=10) for f in futures] == [False] * 3
        st = tier.stats()
        assert st.queue_depth == 0 and st.failures_total == 3
        assert st.health is TierHealth.DEGRADED
        monkeypatch.undo()
        demote_all(tier, [key(9)])
        assert read(tier, key(9)) == block(9)
    finally:
        tier.close()


def test_closing_with_demotions_in_flight_ends_each_and_refuses_after(tmp_path):
    """close() waits for what was handed to the threads (each demotion ends, written or not,
    none raises); a promotion or demotion asked after it is refused, not run."""
    tier = DiskTier(str(tmp_path / "disk"), SIZE, extent_bytes=EXTENT, io_threads=1)
    futures = [tier.demote(key(i), block(i)) for i in range(12)]
    tier.close()
    assert all(f is not None and f.done() and isinstance(f.result(), bool) for f in futures)
    assert tier.promote(key(0), memoryview(bytearray(BLOCK))) is None
    assert tier.demote(key(99), block(99)) is None


# ------------------------------------------------------------- the journal, damaged


def _journal_of(tmp_path, n: int) -> tuple[str, list[int], list[Placed]]:
    """A journal of `n` PUT records: (its path, where each record starts and, last, the file's
    end, the blocks)."""
    path = str(tmp_path / "j")
    journal = Journal(path, SIZE, EXTENT)
    journal.load()
    placed = [Placed(i * BLOCK, BLOCK, BLOCK, i, NS, f"key-{i:04}".encode(), "t")
              for i in range(n)]
    starts = []
    for p in placed:
        starts.append(journal.bytes)
        journal.put(p)
    starts.append(journal.bytes)
    journal.close()
    return path, starts, placed


def _offsets(path: str) -> list[int]:
    j = Journal(path, SIZE, EXTENT)
    try:
        return sorted(p.offset for p in j.load())
    finally:
        j.close()


def test_each_byte_of_a_record_corrupted_costs_that_record_alone(tmp_path, caplog):
    """Any one byte of the records in the middle (their heads: mark, length, CRCs; and
    their bodies) flipped: replay keeps every other record, says "corrupt record at offset N"
    with the record's own offset (never "a write cut short"), and rewrites the journal so the
    next replay finds nothing wrong."""
    path, starts, placed = _journal_of(tmp_path, 16)
    with open(path, "rb") as f:
        good = f.read()
    every = [p.offset for p in placed]
    for i in (7, 8):
        for at in range(starts[i], starts[i + 1]):
            damaged = bytearray(good)
            damaged[at] ^= 0xFF
            with open(path, "wb") as f:
                f.write(damaged)
            caplog.clear()
            assert _offsets(path) == every[:i] + every[i + 1:], at
            assert f"corrupt record at offset {starts[i]} " in caplog.text, (at, caplog.text)
            assert "a write cut short" not in caplog.text
            caplog.clear()
            assert _offsets(path) == every[:i] + every[i + 1:]      # rewritten: found again
            assert "corrupt" not in caplog.text


def test_a_run_of_damage_costs_the_records_it_touches_and_a_torn_tail_is_still_a_torn_tail(
        tmp_path, caplog):
    path, starts, placed = _journal_of(tmp_path, 16)
    with open(path, "r+b") as f:            # 3 records' worth of zeros from inside record 5
        f.seek(starts[5] + 3)
        f.write(bytes(starts[8] - starts[5]))
    every = [p.offset for p in placed]
    assert _offsets(path) == every[:5] + every[9:]
    assert f"corrupt record at offset {starts[5]} " in caplog.text
    caplog.clear()
    with open(path, "r+b") as f:            # the last record cut short: a torn tail
        f.truncate(os.path.getsize(path) - 5)
    assert _offsets(path) == every[:5] + every[9:15]
    assert "a write cut short" in caplog.text and "corrupt record" not in caplog.text


def test_a_version_1_journal_is_read_and_rewritten_as_version_2(tmp_path, caplog):
    """A journal an earlier kvd wrote (version 1: records framed by length and body CRC
    alone) keeps its blocks; it is rewritten in the current framing at once."""
    caplog.set_level("INFO")
    path = str(tmp_path / "j")
    placed = [Placed(i * BLOCK, BLOCK, BLOCK, 1000 + i, NS, f"old-{i}".encode(), "t")
              for i in range(5)]

    def v1(body: bytes) -> bytes:
        return struct.pack("<II", 8 + len(body), zlib.crc32(body)) + body

    data = struct.pack("<8sIQQ", b"KVDDISK1", 1, SIZE, EXTENT)
    for p in placed:
        ns, key, tenant = p.namespace.encode(), p.key, p.tenant.encode()
        data += v1(struct.pack("<BQIIIHHH", 1, p.offset, p.length, p.alloc, p.crc, len(ns),
                               len(key), len(tenant)) + ns + key + tenant)
    data += v1(struct.pack("<BQ", 2, placed[2].offset))                 # DEL
    with open(path, "wb") as f:
        f.write(data)
    j = Journal(path, SIZE, EXTENT)
    try:
        got = sorted(j.load(), key=lambda p: p.offset)
    finally:
        j.close()
    assert got == [p for i, p in enumerate(placed) if i != 2]
    assert "version 1, rewritten as version 2" in caplog.text
    with open(path, "rb") as f:
        assert struct.unpack_from("<8sI", f.read(12)) == (b"KVDDISK1", 2)
    j = Journal(path, SIZE, EXTENT)
    try:
        assert sorted(j.load(), key=lambda p: p.offset) == got
    finally:
        j.close()


def test_a_read_only_load_changes_nothing_on_the_disk(tmp_path, caplog):
    path, starts, placed = _journal_of(tmp_path, 8)
    with open(path, "r+b") as f:
        f.seek(starts[3] + 20)
        f.write(b"\xff")
        f.truncate(os.path.getsize(path) - 3)
    with open(path, "rb") as f:
        before = f.read()
    j = Journal(path, SIZE, EXTENT)
    assert sorted(p.offset for p in j.load(read_only=True)) == \
        [p.offset for i, p in enumerate(placed) if i not in (3, 7)]
    with pytest.raises(OSError):
        j.put(placed[0])
    j.close()
    with open(path, "rb") as f:
        assert f.read() == before
    assert "rewritten" not in caplog.text


# ------------------------------------------------- the directory, removed or shared


def _open_paths() -> list[str]:
    """What this process's descriptors point at (an unlinked file: "PATH (deleted)")."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return out


def test_a_directory_removed_under_the_tier_is_given_up_and_opened_again(tmp_path, caplog):
    """rm -rf of the tier's directory: within a tick or two the tier is degraded (the reason
    names the directory), its blocks are forgotten and told, its files closed, no demotion is
    taken; after retry_s it makes the directory again, empty, and writes."""
    told: list[TierKey] = []
    t = DiskTier(str(tmp_path / "disk"), SIZE, extent_bytes=EXTENT, io_threads=2, retry_s=1.0)
    t.on_dropped = told.extend
    try:
        keys = [key(i) for i in range(4)]
        demote_all(t, keys)
        shutil.rmtree(t.directory)
        for _ in range(300):
            if t.stats().health is TierHealth.DEGRADED:
                break
            time.sleep(0.01)
        st = t.stats()
        assert st.health is TierHealth.DEGRADED and st.reason.startswith("directory removed")
        assert t.directory in st.reason and "removed while in use" in caplog.text
        assert (st.blocks, st.used_bytes) == (0, 0) and set(told) == set(keys)
        assert not t.readable and read(t, keys[0]) is None
        assert t.demote(key(9), block(9)) is None
        for _ in range(300):                   # closed once no I/O batch uses it
            if not [p for p in _open_paths() if DATA_FILE in p]:
                break
            time.sleep(0.01)
        assert not [p for p in _open_paths() if DATA_FILE in p]
        for _ in range(500):
            if t.stats().health is TierHealth.OK:
                break
            time.sleep(0.01)
        assert t.stats().health is TierHealth.OK
        demote_all(t, [key(10)])
        assert read(t, key(10)) == block(10)
    finally:
        t.close()
