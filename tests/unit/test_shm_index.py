"""The shared block index without a daemon: what the daemon writes (ShmIndex) is exactly what
an engine reads (its IndexReader's mapping, probed by the session's Lookups), through every
insert, removal, reuse and reset; the engine's copy cannot write it; and freed slots come back
only once every reader has moved past them (Reclamation, with the engine's own Marks
publishing)."""

from __future__ import annotations

import fcntl
import mmap
import os
import random
import struct
from collections.abc import Iterator

import pytest

from kvd_client.link.index_reader import STATE_READY, STATE_STORING, IndexReader, Marks
from kvd_proto.index_layout import HEADER_BYTES, MAX_PROBE, key_hash
from kvd_proto.native import Lookups
from kvd_server.memory.shm_index import Reclamation, ShmIndex

WIDTH = 16                  # key width of the test indexes
STRIDE = 4096
PER_EXTENT = 4
EXTENT = PER_EXTENT * STRIDE + 8192     # a gap after each extent's slots, as a real pool has


def make_index(capacity: int = 32, width: int = WIDTH) -> ShmIndex:
    return ShmIndex(capacity, width, PER_EXTENT, STRIDE, EXTENT, name="kvd-index-test")


def offset_of(slot: int) -> int:
    return slot // PER_EXTENT * EXTENT + slot % PER_EXTENT * STRIDE


class EngineView:
    """What an engine reads: the daemon's descriptor, mapped read-only (IndexReader), probed as
    its session's lookups probe it (kvd_proto.native.Lookups, compiled where built)."""

    def __init__(self, fd: int) -> None:
        self.reader = IndexReader(fd)
        self.lookups = Lookups({}, "MISS", "HIT", lambda key: "SLOW")
        self.lookups.bind(self.reader.mapping, *self.reader.header.geometry)

    def find(self, key: bytes) -> tuple[int, int] | None:
        return self.lookups.find(key)

    def close(self) -> None:
        self.lookups.unbind()
        self.reader.close()


def reader_of(index: ShmIndex) -> EngineView:
    """What an engine gets: a duplicate of the daemon's descriptor, mapped read-only."""
    return EngineView(os.dup(index.fd))


@pytest.fixture
def index() -> Iterator[ShmIndex]:
    idx = make_index()
    try:
        yield idx
    finally:
        idx.close()


@pytest.fixture
def reader(index: ShmIndex) -> Iterator[EngineView]:
    r = reader_of(index)
    try:
        yield r
    finally:
        r.close()


def keys_with_home(home: int, mask: int, n: int, tag: str) -> list[bytes]:
    """`n` distinct keys whose first bucket is `home` (they all collide)."""
    out: list[bytes] = []
    i = 0
    while len(out) < n:
        key = f"{tag}/{home}/{i}".encode()
        if key_hash(key) & mask == home:
            out.append(key)
        i += 1
    return out


# --------------------------------------------------------------------------- round trips


def test_a_key_goes_storing_ready_and_away(index, reader):
    key = b"block-0001"
    assert reader.find(key) is None
    assert index.insert(5, key)
    assert reader.find(key) == (STATE_STORING, offset_of(5))
    index.set_ready(5)
    assert reader.find(key) == (STATE_READY, offset_of(5))
    assert reader.find(key) == (STATE_READY, offset_of(5))       # asked again
    index.remove(5)
    assert reader.find(key) is None
    index.remove(5)                                               # idempotent
    assert reader.find(key) is None


def test_a_reused_slot_answers_for_its_new_key_only(index, reader):
    old, new = b"old-key", b"new-key"
    index.insert(3, old)
    index.set_ready(3)
    assert reader.find(old) == (STATE_READY, offset_of(3))
    index.remove(3)
    index.insert(3, new)
    index.set_ready(3)
    assert reader.find(old) is None, "an answer outlived the slot's reuse"
    assert reader.find(new) == (STATE_READY, offset_of(3))
    # The old key comes back in another slot: the answer follows it.
    index.insert(7, old)
    assert reader.find(old) == (STATE_STORING, offset_of(7))
    # The same key stored again in the same slot is being stored, not READY as it was.
    index.remove(3)
    index.insert(3, new)
    assert reader.find(new) == (STATE_STORING, offset_of(3))
    index.set_ready(3)
    assert reader.find(new) == (STATE_READY, offset_of(3))


def test_clear_forgets_every_key_and_no_answer_survives_it(index, reader):
    keys = [b"k%02d" % i for i in range(10)]
    for slot, key in enumerate(keys):
        index.insert(slot, key)
        if slot % 2 == 0:
            index.set_ready(slot)
    for slot, key in enumerate(keys):
        state = STATE_READY if slot % 2 == 0 else STATE_STORING
        assert reader.find(key) == (state, offset_of(slot))
    index.clear()
    for key in keys:
        assert reader.find(key) is None, f"{key!r} answered after clear()"
    # After the reset the same slots take the same keys again, and other keys.
    index.insert(0, keys[0])
    assert reader.find(keys[0]) == (STATE_STORING, offset_of(0))
    index.insert(2, b"other")
    index.set_ready(2)
    assert reader.find(keys[2]) is None
    assert reader.find(b"other") == (STATE_READY, offset_of(2))
    # A reader mapped after the reset agrees.
    fresh = reader_of(index)
    try:
        assert fresh.find(keys[0]) == (STATE_STORING, offset_of(0))
        assert fresh.find(keys[2]) is None
    finally:
        fresh.close()


def test_a_key_longer_than_the_width_is_refused_and_never_found(index, reader):
    short = b"x" * WIDTH
    long = short + b"y"
    assert index.insert(0, short)
    index.set_ready(0)
    assert not index.fits(long)
    assert not index.insert(1, long), "a key longer than the index's width was indexed"
    assert reader.find(long) is None
    assert reader.find(short) == (STATE_READY, offset_of(0))
    assert reader.find(short[:-1]) is None          # a prefix is another key


# ------------------------------------------------------------------------- model check


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_index_matches_a_dict_under_random_inserts_and_removals(seed):
    """Random inserts and removals (many keys colliding in a few buckets, runs that wrap
    around the end of the bucket array), against a dict: after every operation both a
    long-lived reader and, now and then, a fresh one answer exactly what the
    dict says. Backward-shift deletion must keep every other key of a run findable."""
    rng = random.Random(seed)
    capacity = 48                                   # below MAX_PROBE: an insert never overflows
    idx = make_index(capacity)
    mask = idx.header.buckets - 1
    keys = (keys_with_home(mask - 1, mask, 8, "wrap") + keys_with_home(mask, mask, 8, "wrap")
            + keys_with_home(0, mask, 6, "wrap") + keys_with_home(40, mask, 10, "hot")
            + [f"random/{seed}/{i}".encode() for i in range(60)])
    rng.shuffle(keys)
    where: dict[bytes, int] = {}                    # key -> slot
    ready: set[bytes] = set()
    free = list(range(capacity))
    live = reader_of(idx)
    try:
        for op in range(1500):
            roll = rng.random()
            if roll < 0.5 and free:
                key = rng.choice([k for k in keys if k not in where])
                slot = free.pop(rng.randrange(len(free)))
                assert idx.insert(slot, key), f"op {op}: insert failed below MAX_PROBE"
                where[key] = slot
            elif roll < 0.65 and where:
                key = rng.choice(sorted(where))
                idx.set_ready(where[key])
                ready.add(key)
            elif roll < 0.995 and where:
                key = rng.choice(sorted(where))
                slot = where.pop(key)
                ready.discard(key)
                idx.remove(slot)
                free.append(slot)
            elif roll >= 0.995:
                idx.clear()
                free.extend(where.values())
                where.clear()
                ready.clear()
            readers = [live]
            if op % 100 == 0:
                readers.append(reader_of(idx))
            for r in readers:
                for key in keys:
                    slot = where.get(key)
                    want = None if slot is None else (
                        STATE_READY if key in ready else STATE_STORING, offset_of(slot))
                    assert r.find(key) == want, (
                        f"seed {seed} op {op}: {key!r} answered {r.find(key)}, model {want}")
            for r in readers[1:]:
                r.close()
    finally:
        live.close()
        idx.close()


def test_a_run_longer_than_max_probe_overflows_and_recovers():
    idx = make_index(capacity=256)
    mask = idx.header.buckets - 1
    colliding = keys_with_home(mask - 10, mask, MAX_PROBE + 2, "ov")
    r = reader_of(idx)
    try:
        for slot, key in enumerate(colliding[:MAX_PROBE]):
            assert idx.insert(slot, key)
        extra = colliding[MAX_PROBE]
        assert not idx.insert(MAX_PROBE, extra)
        assert idx.overflows_total == 1
        assert r.find(extra) is None                # not indexed: a miss, never a wrong slot
        for slot, key in enumerate(colliding[:MAX_PROBE]):
            assert r.find(key) == (STATE_STORING, offset_of(slot))
        idx.remove(17)                              # a hole in the middle of the run
        assert r.find(colliding[17]) is None
        assert idx.insert(MAX_PROBE, extra)         # room again within MAX_PROBE
        assert r.find(extra) == (STATE_STORING, offset_of(MAX_PROBE))
        for slot, key in enumerate(colliding[:MAX_PROBE]):
            if slot != 17:
                assert r.find(key) == (STATE_STORING, offset_of(slot))
    finally:
        r.close()
        idx.close()


# ----------------------------------------------------------------- the reader's side


def test_the_readers_descriptor_cannot_write_resize_or_reseal(index):
    fd = os.dup(index.fd)
    size = index.header.file_bytes
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.write(fd, b"x")
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", HEADER_BYTES)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 2 * size)
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        # Reopening the file through /proc gives no write access either.
        again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.write(again, b"x")
        finally:
            os.close(again)
        # Read-only, it works, and sees the daemon's writes as they happen.
        r = EngineView(fd)
        fd = -1
        try:
            index.insert(2, b"visible")
            index.set_ready(2)
            assert r.find(b"visible") == (STATE_READY, offset_of(2))
        finally:
            r.close()
    finally:
        if fd >= 0:
            os.close(fd)


def _memfd_with(data: bytes, size: int | None = None) -> int:
    fd = os.memfd_create("kvd-index-corrupt", os.MFD_CLOEXEC)
    os.ftruncate(fd, size if size is not None else max(len(data), 4096))
    os.pwrite(fd, data, 0)
    return fd


@pytest.mark.parametrize("field, value, message", [
    ("magic", b"NOTANIDX", "not a kvd index of version 1"),
    ("version", 2, "version 2"),
    ("header_bytes", 512, "not a kvd index of version 1"),
])
def test_a_corrupt_header_is_refused_with_a_clear_message(index, field, value, message):
    header = bytearray(index.header.pack())
    if field == "magic":
        header[0:8] = value
    elif field == "version":
        struct.pack_into("<I", header, 8, value)
    else:
        struct.pack_into("<I", header, 12, value)
    fd = _memfd_with(bytes(header), index.header.file_bytes)
    try:
        with pytest.raises(ValueError, match=message):
            IndexReader(fd)
    finally:
        os.close(fd)


def test_a_file_shorter_than_its_layout_is_refused(index):
    fd = _memfd_with(index.header.pack(), 4096)        # the header of a 32-slot index
    try:
        with pytest.raises(ValueError, match="smaller than its layout says"):
            IndexReader(fd)
    finally:
        os.close(fd)


def test_a_file_shorter_than_a_header_is_refused(index):
    fd = _memfd_with(index.header.pack()[:16], 16)
    try:
        with pytest.raises(ValueError, match="kvd index"):
            IndexReader(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------- reclamation


class Readers:
    """A Reclamation with engines attached the way the daemon attaches them: the daemon
    creates each reader's marks file, the engine publishes through its own mapping of it."""

    def __init__(self) -> None:
        self.index = make_index(capacity=16)
        self.rec = Reclamation(self.index)
        self.marks: dict[str, Marks] = {}

    def attach(self, name: str) -> Marks:
        daemon_side = self.rec.add_reader(name)
        marks = self.marks[name] = Marks(os.dup(daemon_side.fd))
        return marks

    def free(self, *slots: int) -> None:
        """What the daemon does to free slots: unpublish, retire, then raise the epoch."""
        for slot in slots:
            self.index.remove(slot)
            self.rec.retire(slot)
        self.rec.seal()

    def close(self) -> None:
        for marks in self.marks.values():
            marks.close()
        self.rec.close()
        self.index.close()


@pytest.fixture
def readers() -> Iterator[Readers]:
    r = Readers()
    try:
        yield r
    finally:
        r.close()


def test_without_readers_a_freed_slot_comes_back_at_once(readers):
    readers.free(1, 2)
    assert sorted(readers.rec.collect()) == [1, 2]
    assert readers.rec.in_limbo == 0


def test_a_reader_that_published_on_attach_holds_what_is_freed_after(readers):
    """An engine publishes the reclaim epoch it sees when it maps the index, before any
    lookup: a fresh namespace's first frees must wait for it like any other."""
    a = readers.attach("a")
    a.publish(readers.index.reclaim_epoch)
    readers.free(3)
    assert readers.rec.collect() == [], "a slot came back while a reader could still read it"
    assert readers.rec.in_limbo == 1
    a.publish(readers.index.reclaim_epoch)
    assert readers.rec.collect() == [3]
    assert readers.rec.in_limbo == 0


def test_an_older_epoch_holds_and_a_current_one_releases_in_order(readers):
    a = readers.attach("a")
    a.publish(readers.index.reclaim_epoch)
    first = readers.index.reclaim_epoch
    readers.free(1)
    second = readers.index.reclaim_epoch
    readers.free(2, 3)
    third = readers.index.reclaim_epoch
    assert first < second < third
    assert readers.rec.collect() == []
    a.publish(second)                   # moved past the first free only
    assert readers.rec.collect() == [1]
    assert readers.rec.collect() == []
    a.publish(third)
    assert sorted(readers.rec.collect()) == [2, 3]


def test_an_unpublished_reader_holds_nothing(readers):
    readers.attach("silent")            # mapped the index, never published (0)
    readers.free(4)
    assert readers.rec.collect() == [4]


def test_a_garbage_epoch_does_not_release_what_another_reader_holds(readers):
    honest = readers.attach("honest")
    honest.publish(readers.index.reclaim_epoch)
    liar = readers.attach("liar")
    liar.publish(2**64 - 1)
    readers.free(5)
    assert readers.rec.collect() == [], "one reader's garbage released another's slot"
    liar.publish(1)
    assert readers.rec.collect() == []
    honest.publish(readers.index.reclaim_epoch)
    assert readers.rec.collect() == [], "the liar's old epoch holds too"
    liar.publish(2**64 - 1)
    assert readers.rec.collect() == [5]


def test_an_ended_reader_whose_process_lives_holds_until_released(readers):
    a = readers.attach("a")
    a.publish(readers.index.reclaim_epoch)
    readers.free(6)
    readers.rec.end_reader("a", process_lives=True)
    assert readers.rec.active
    assert readers.rec.collect() == [], "an ended reader's process may still be copying"
    readers.free(7)
    assert readers.rec.collect() == []
    assert readers.rec.release_reader("a")
    assert not readers.rec.release_reader("a")
    assert sorted(readers.rec.collect()) == [6, 7]
    assert not readers.rec.active


def test_an_ended_reader_whose_process_is_gone_holds_nothing(readers):
    a = readers.attach("a")
    a.publish(readers.index.reclaim_epoch)
    readers.free(8)
    readers.rec.end_reader("a", process_lives=False)
    assert readers.rec.collect() == [8]
    assert not readers.rec.release_reader("a")
