"""The index loops, compiled (kvd_proto._native) and their pure-Python twins
(kvd_proto/native.py): on the same operations they write the same bytes into the index and give
the same answers, and the engine's lookups answer HIT / MISS at once and hand everything else
to the fallback, with the counts the daemon is told. The twins run everywhere; the compiled
types where the extension was built (in CI it is: `make test` builds it)."""

from __future__ import annotations

import mmap
import os
import random
import struct
import zlib

import pytest

from kvd_proto import native
from kvd_proto.index_layout import STATE_READY, STATE_STORING, Header, buckets_for
from kvd_proto.native import PyIndexTable, PyLookups

try:
    from kvd_proto import _native
except ImportError:                      # no compiler at install: the twins only
    _native = None

WIDTH = 40
needs_native = pytest.mark.skipif(_native is None, reason="kvd_proto._native was not built "
                                  "(no C compiler or Python headers at install)")


def layout(capacity: int = 64) -> Header:
    return Header(capacity=capacity, buckets=buckets_for(capacity), key_width=WIDTH,
                  per_extent=16, stride=8192, extent_bytes=16 * 8192 + 4096)


def fresh(h: Header) -> mmap.mmap:
    m = mmap.mmap(-1, h.file_bytes)
    m[:len(h.pack())] = h.pack()
    return m


def tables(h: Header) -> list[tuple[object, mmap.mmap]]:
    out = []
    kinds = [PyIndexTable] + ([_native.IndexTable] if _native is not None else [])
    for kind in kinds:
        m = fresh(h)
        out.append((kind(m, *h.geometry), m))
    return out


def test_the_switch_names_what_is_in_use():
    compiled = native.IndexTable is not PyIndexTable
    assert compiled == native.NATIVE
    assert native.crc32(b"kvd") == zlib.crc32(b"kvd")


@needs_native
def test_the_compiled_crc_is_zlibs():
    rng = random.Random(3)
    for n in range(0, 300, 7):
        data = rng.randbytes(n)
        assert _native.crc32(data) == zlib.crc32(data)


@pytest.mark.parametrize("seed", range(4))
def test_both_write_the_same_index_and_answer_alike(seed):
    """Random inserts, removals (backward-shift deletion through long probe runs: a small
    index) and lookups: every answer and every byte of the index equal."""
    h = layout(48)
    pairs = tables(h)
    rng = random.Random(seed)
    keys = [rng.randbytes(rng.randint(1, WIDTH)) for _ in range(200)] + [b"x" * (WIDTH + 1)]
    where: dict[bytes, int] = {}
    free = list(range(h.capacity))
    for _ in range(3000):
        key = rng.choice(keys)
        if key in where and rng.random() < 0.5:
            slot = where.pop(key)
            for table, _ in pairs:
                table.remove(slot)
            free.append(slot)
        elif key not in where and free:
            slot = free.pop(rng.randrange(len(free)))
            answers = {table.insert(slot, key) for table, _ in pairs}
            assert len(answers) == 1
            if answers.pop():
                where[key] = slot
            else:
                free.append(slot)
        probe = rng.choice(keys)
        assert len({table.find(probe) for table, _ in pairs}) == 1
        assert pairs[0][0].find(probe) == where.get(probe, -1)
    for slot in range(h.capacity):
        assert len({table.key_of(slot) for table, _ in pairs}) == 1
    maps = [bytes(m) for _, m in pairs]
    assert all(m == maps[0] for m in maps)


@pytest.mark.parametrize("kind", ["python", "compiled"])
def test_lookups_answer_hits_and_misses_and_leave_the_rest_to_the_fallback(kind):
    if kind == "compiled" and _native is None:
        pytest.skip("kvd_proto._native was not built")
    h = layout()
    m = fresh(h)
    writer = PyIndexTable(m, *h.geometry)
    ready, storing, own, absent = b"r" * 36, b"s" * 36, b"o" * 36, b"a" * 36
    writer.insert(3, ready)
    writer.insert(17, storing)
    meta = memoryview(m)[h.meta_offset:h.meta_offset + 8 * h.capacity].cast("Q")
    meta[3] = meta[3] & ~3 | STATE_READY
    stores = {own: (0, None)}
    fell: list[bytes] = []
    lookups_type = PyLookups if kind == "python" else _native.Lookups
    lk = lookups_type(stores, "MISS", "HIT", lambda k: fell.append(k) or "SLOW")
    assert lk.lookup(ready) == "SLOW" and fell == [ready]     # not bound, not enabled
    lk.bind(m, *h.geometry)
    assert lk.bound and lk.lookup(ready) == "SLOW"            # bound, not enabled
    lk.enabled = 1
    assert lk.lookup(ready) == "HIT" and lk.recorded() == {ready: h.offset_of(3)}
    assert lk.hit_offset(ready) == h.offset_of(3) and lk.hit_offset(absent) is None
    assert lk.lookup(absent, object()) == "MISS"
    assert lk.lookup(storing) == "SLOW" and lk.lookup(own) == "SLOW"
    assert (lk.lookups, lk.hits, lk.misses) == (2, 1, 1)      # the slow ones count there
    assert lk.find(ready) == (STATE_READY, h.offset_of(3))
    assert lk.find(storing) == (STATE_STORING, h.offset_of(17))
    assert lk.find(absent) is None
    assert lk.find_new([ready, own, absent, storing], True) == [absent]
    assert lk.find_new([ready, own, absent], False) == [ready, absent]
    lk.unbind()
    assert not lk.bound and not lk.enabled and lk.lookup(ready) == "SLOW"
    meta.release()
    writer.release()
    m.close()                              # unbound: the mapping is free to close


def _steps_world():
    """An index with a READY, a STORING key; a compiled Lookups over it, enabled, its stores
    holding one store of the engine in flight."""
    h = layout()
    m = fresh(h)
    writer = PyIndexTable(m, *h.geometry)
    writer.insert(3, b"r" * 36)
    writer.insert(17, b"s" * 36)
    meta = memoryview(m)[h.meta_offset:h.meta_offset + 8 * h.capacity].cast("Q")
    meta[3] = meta[3] & ~3 | STATE_READY
    meta.release()
    writer.release()
    stores: dict[bytes, object] = {b"o" * 36: (0, "old")}
    lk = _native.Lookups(stores, "MISS", "HIT", lambda k: "SLOW")
    lk.bind(m, *h.geometry)
    lk.enabled = 1
    return lk, stores, m


# The scheduler's compiled steps (kvd_proto/_steps.c) against what they promise: the common
# case done, anything else answered None with nothing changed (the session's Python path then
# decides it). That they answer, change the containers and write the records as that path
# (their one twin) does is tests/unit/test_steps_differential.py's.

STORE_CASES = [
    # (keys, positions, slots, per_record, room): the compiled store's common case or None
    ([b"a" * 36, b"r" * 36, b"b" * 36, b"o" * 36, b"s" * 36], range(10, 15), [7, 8, 9], 8, 99),
    ([b"a" * 36, b"b" * 36], [1, 2, 3], [7, 8], 8, 99),          # positions not one per key
    ([b"a" * 36, b"b" * 36], None, [7], 8, 99),                  # the reserve is short
    ([b"a" * 36, b"b" * 36], None, [7, 8], 8, 1),                # the tracker's bound
    ([b"a" * 36, b"a" * 36], None, [7, 8], 8, 99),               # a key named twice
    ([b"a" * 36, b"b" * 36, b"c" * 36], None, [7, 8, 9], 2, 99),  # more than a record
    ([b"r" * 36, b"o" * 36], range(2), [7], 8, 99),              # nothing new
    ([], None, [7], 8, 99),
    ([b"a" * 36, "text"], None, [7, 8], 8, 99),                  # not bytes
]
STORE_DECLINED = {2, 3, 4, 5, 7, 8}


@needs_native
@pytest.mark.parametrize("case", range(len(STORE_CASES)))
def test_the_compiled_store_does_the_common_case_and_declines_the_rest(case):
    """The new keys (neither the engine's stores nor in the index) take the reserve's last
    slots, become the engine's stores, and the STORE record names them; or None, with the
    stores and the slot list as they were."""
    keys, positions, slots, per_record, room = STORE_CASES[case]
    lk, stores, m = _steps_world()
    before = dict(stores)
    left = list(slots)
    got = lk.store(keys, positions, "req-1", left, "shared", per_record, room)
    if case in STORE_DECLINED:
        assert got is None and stores == before and left == slots
    else:
        new = [k for k in keys if k not in before and k not in (b"r" * 36, b"s" * 36)]
        taken = slots[len(slots) - len(new):]
        assert got[:2] == (new, taken) and left == slots[:len(slots) - len(new)]
        assert stores == {**before, **{k: (o, "shared") for k, o in zip(new, taken)}}
        pos = positions if positions is not None and len(positions) == len(keys) else None
        index = [keys.index(k) for k in new]
        assert got[2] == (native.keys_record(1, b"", "req-1", keys, True, pos, index, taken)
                          if new else None)
    if case == 0:
        assert got[0] == [b"a" * 36, b"b" * 36] and got[1] == [8, 9] and left == [7]
    lk.unbind()
    m.close()


@needs_native
def test_the_store_fast_path_changes_nothing_when_it_fails_or_is_off():
    lk, stores, m = _steps_world()
    before = dict(stores)
    slots = [7, 8]
    with pytest.raises(ValueError):                       # a request id too long to encode
        lk.store([b"a" * 36], None, "x" * 70000, slots, "shared", 8, 99)
    assert stores == before and slots == [7, 8]
    lk.enabled = 0
    assert lk.store([b"a" * 36], None, "r", slots, "shared", 8, 99) is None
    assert stores == before and slots == [7, 8]
    with pytest.raises(TypeError):
        lk.store([b"a" * 36], None, "r", (7, 8), "shared", 8, 99)
    lk.unbind()
    m.close()


@needs_native
def test_the_compiled_pin_takes_a_whole_pin_of_hits_and_declines_the_rest():
    """Every key a HIT of this step, distinct, one record's worth: their offsets (as
    `hit_offset` finds them, what the Python path loads), their set, the PIN record and the
    COMPLETE_LOAD record of the whole pin; else None."""
    a, b, c = b"a" * 36, b"b" * 36, b"c" * 36
    for keys, positions, per_record in (([a, b], range(2), 8), ([a, b], None, 8),
                                        ([a, c], None, 8), ([a, a], None, 8),
                                        ([a, b], None, 1), ([], None, 8)):
        lk, _, m = _steps_world()
        lk.hit(a, 4096)
        lk.hit(b, 8192)
        got = lk.pin(keys, positions, "req-2", per_record, 6)
        if keys not in ([a, b],) or per_record < 2:
            assert got is None, keys
        else:
            offsets = [lk.hit_offset(k) for k in keys]
            assert got == (offsets, frozenset(keys),
                           native.keys_record(3, b"", "req-2", keys, True, positions, None,
                                              offsets),
                           native.keys_record(4, struct.pack("<Q", 6), "req-2", keys, False,
                                              None, None, None))
        lk.unbind()
        m.close()
    lk, _, m = _steps_world()
    lk.hit(a, 4096)
    lk.hit(b, 8192)
    offsets, keyset, record, done = lk.pin([a, b], range(5, 7), "req-2", 8, 6)
    assert offsets == [4096, 8192] and keyset == frozenset((a, b))
    assert record == native.keys_record(3, b"", "req-2", [a, b], True, range(5, 7), None,
                                        [4096, 8192])
    assert done == native.keys_record(4, struct.pack("<Q", 6), "req-2", [a, b], False, None,
                                      None, None)            # its whole completion
    lk.unbind()
    m.close()


@needs_native
def test_the_compiled_completion_and_settling_change_the_containers_as_the_tracker_does():
    """complete (a successful completion's common case: every key a store in flight of one
    step, of a known epoch, distinct, one record's worth) answers the entry to settle and the
    record, or None with nothing changed; settle (forgetting what the daemon read) leaves the
    stores and completed sets as its Python twin, the tracker's own forgetting, does."""
    from kvd_client.offload.stores import Shared, StoreTracker

    a, b, c, d = (bytes([x]) * 36 for x in b"abcd")
    one, two, unknown = Shared(5, 9), Shared(5, 10), Shared(-1, 11)
    cases = [([a, b], 8), ({a, b}, 8), ([a, c], 8), ([a, a], 8), ([a, b], 1), ([d], 8), ([], 8),
             ([c], 8)]
    for keys, per_record in cases:
        lk, stores, m = _steps_world()
        stores.update({a: (4096, one), b: (8192, one), c: (0, two), d: (12288, unknown)})
        before = dict(stores)
        completed: dict[bytes, None] = {}
        got = lk.complete(keys, completed, "req-3", per_record)
        handled = (list(keys) in ([a, b], [b, a], [c])) and per_record > 1
        if not handled:
            assert got is None and completed == {} and stores == before, keys
        else:
            order = tuple(keys)
            shared = before[order[0]][1]
            assert got[0][:3] == (shared.seq, order, tuple(before[k] for k in order))
            assert got[0][3] == struct.pack(f"<{len(order)}q", *map(hash, order))
            assert got[1] == native.keys_record(2, struct.pack("<QB", 5, True), "req-3",
                                                list(order), False, None, None, None)
            assert completed == dict.fromkeys(order) and stores == before
        lk.unbind()
        m.close()
    for forget in ("compiled", "tracker"):
        lk, stores, m = _steps_world()
        tracker = StoreTracker()
        tracker.stores = stores
        settle = lk.settle if forget == "compiled" else tracker.forget
        newer, sa, sb = (16384, two), (4096, one), (8192, one)
        stores.update({a: sa, b: newer})        # b was stored again since: left alone
        completed = dict.fromkeys((a, b))
        settle([(9, (a, b), (sa, sb))], completed)
        assert stores == {b"o" * 36: (0, "old"), b: newer} and completed == {b: None}
        stores[a], completed[a] = sa, None                 # again, with the keys' hashes
        settle([(9, (a,), (sa,), struct.pack("<q", hash(a)))], completed)
        assert a not in stores and a not in completed
        if forget == "compiled":
            with pytest.raises(TypeError):
                settle([(9, (a, b), (sa,))], completed)
        lk.unbind()
        m.close()


@needs_native
def test_the_compiled_types_refuse_a_mapping_their_geometry_does_not_fit():
    h = layout()
    with pytest.raises(ValueError, match="past the end"):
        _native.IndexTable(mmap.mmap(-1, 4096), *h.geometry)
    bad = list(h.geometry)
    bad[1] = 100                                              # buckets: not a power of two
    with pytest.raises(ValueError, match="not a valid layout"):
        _native.IndexTable(fresh(h), *bad)
    table = _native.IndexTable(fresh(h), *h.geometry)
    with pytest.raises(IndexError):
        table.remove(h.capacity)
    table.release()
    with pytest.raises(ValueError, match="released"):
        table.find(b"k")


def _record_args(rng: random.Random) -> tuple:
    """Random arguments of `keys_record` as the encoders pass them."""
    n = rng.choice([0, 1, 2, 16, 75, 300])
    width = rng.choice([0, 1, 32, 40])
    keys = [rng.randbytes(width or rng.randint(0, 255)) for _ in range(n)]
    with_positions = rng.random() < 0.6
    positions = rng.choice([None, [], range(rng.randint(-5, 5), rng.randint(-5, 5) + 16 * n, 16)
                            if n else [],
                            [rng.randint(-(1 << 63), (1 << 63) - 1) for _ in range(n)]])
    if positions is not None and len(positions) != n:
        positions = None
    index = rng.choice([None, range(n), [rng.randint(0, (1 << 32) - 1) for _ in range(n // 2)]])
    offsets = rng.choice([None, [rng.randint(0, (1 << 64) - 1) for _ in range(n)],
                          range(0, 4096 * n, 4096)])
    prefix = rng.randbytes(rng.choice([0, 8, 9]))
    req_id = rng.choice([None, "", "req-1", "é" * rng.randint(0, 300)])
    return (rng.randint(0, 0xFFFF), prefix, req_id, keys, with_positions, positions, index,
            offsets)


@needs_native
@pytest.mark.parametrize("seed", range(8))
def test_both_encode_every_record_to_the_same_bytes(seed):
    rng = random.Random(seed)
    for _ in range(200):
        args = _record_args(rng)
        assert _native.keys_record(*args) == native.py_keys_record(*args), args


@needs_native
@pytest.mark.parametrize("args, error", [
    ((1, b"", "r", [b"k", 1], True, None, None, None), TypeError),
    ((1, b"", "r", [b"k" * 256], True, None, None, None), ValueError),
    ((1, b"", "r", [b"a", b"b"], True, [1], None, None), ValueError),
    ((1, b"", "r", [b"a"], False, None, [-1], None), OverflowError),
    ((1, b"", "r", [b"a"], False, None, [1 << 32], None), OverflowError),
    ((1, b"", "r", [b"a"], False, None, None, [-1]), OverflowError),
    ((1, b"", "r", [b"a"], False, None, None, [1 << 64]), OverflowError),
    ((1, b"", "r", [b"a"], True, [1 << 63], None, None), OverflowError),
    ((1, b"", "r", [b"a"], False, None, None, ["1"]), TypeError),
    ((1, b"", "r" * 70000, [b"a"], False, None, None, None), ValueError),
    ((1 << 16, b"", "r", [b"a"], False, None, None, None), OverflowError),
    ((1, "p", "r", [b"a"], False, None, None, None), TypeError),
])
def test_the_compiled_encoder_refuses_what_does_not_fit(args, error):
    """Bad input is an exception naming it, never a record with wrong bytes."""
    with pytest.raises(error):
        _native.keys_record(*args)


@pytest.mark.parametrize("kind", ["python", "compiled"])
def test_an_eventfd_is_signalled_and_a_full_one_says_so(kind):
    if kind == "compiled" and _native is None:
        pytest.skip("kvd_proto._native was not built")
    signal = _native.eventfd_signal if kind == "compiled" else native.py_eventfd_signal
    fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        assert signal(fd) and signal(fd)
        assert os.eventfd_read(fd) == 2
        os.eventfd_write(fd, (1 << 64) - 2)          # the counter's maximum
        assert signal(fd) is False                   # full: the reader is woken anyway
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        signal(fd)                                   # closed


@needs_native
def test_the_compiled_key_positions_are_the_twins():
    """key_positions (the keys' token positions for the daemon's eviction order) against its
    Python twin: consecutive chunks as a range, anything else key by key, None when one has
    none (and an error from the engine's callable goes through)."""
    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(0, 12)
        keys = [rng.randbytes(8) for _ in range(n)]
        start, step = rng.randint(0, 100), rng.choice([16, 16, 16, 0, -16, 7])
        table = {k: start + step * i for i, k in enumerate(keys)}
        for k in keys:
            roll = rng.random()
            if roll < 0.05:
                table[k] = None
            elif roll < 0.1:
                table[k] = rng.randint(0, 200)
        assert _native.key_positions(table.get, keys) == native.py_key_positions(table.get, keys)
        assert _native.key_positions(table, keys) == native.py_key_positions(table.get, keys)
        assert native.py_key_positions(table, keys) == native.py_key_positions(table.get, keys)

    def broken(key: bytes) -> int:
        raise KeyError(key)

    with pytest.raises(KeyError):
        _native.key_positions(broken, [b"k"])


@needs_native
def test_a_whole_call_completes_with_the_record_its_store_made():
    """store makes, while the keys are at hand, the COMPLETE_STORE record their whole
    successful completion sends; complete of exactly those keys (vLLM passes them as a set)
    sends it, the same bytes as one encoded then."""
    from kvd_client.offload.stores import Shared

    a, b, c = b"a" * 36, b"b" * 36, b"c" * 36
    lk, stores, m = _steps_world()
    shared = Shared(3, 12)
    new, taken, _ = lk.store([a, b, b"r" * 36], None, "req-4", [7, 8, 9], shared, 8, 99)
    assert new == [a, b] and taken == [8, 9]
    call = stores[a][2]
    assert stores[b][2] is call and call[1] == 2
    expected = native.keys_record(2, struct.pack("<QB", 3, True), "req-4", [a, b], False,
                                  None, None, None)
    assert call[0] == expected
    completed: dict[bytes, None] = {}
    entry, record = lk.complete({b, a}, completed, "req-4", 8)
    assert record == expected and completed.keys() == {a, b}
    lk.store([c], None, "req-5", [10], shared, 8, 99)
    entry, record = lk.complete([c, a], {}, "req-5", 8)    # two calls' keys: encoded
    assert record == native.keys_record(2, struct.pack("<QB", 3, True), "req-5", [c, a],
                                        False, None, None, None)
    lk.unbind()
    m.close()


@needs_native
def test_same_set_is_true_only_for_sets_of_the_same_objects():
    """The compiled `same_set` (and the twin, which knows only identity) never calls two
    different sets the same; sets built from one list in one order are (vLLM's job keys and
    the pin's frozenset)."""
    rng = random.Random(11)
    for _ in range(300):
        keys = [rng.randbytes(36) for _ in range(rng.randint(0, 90))]
        a, b = frozenset(keys), set(keys)
        assert _native.same_set(a, b) and native.py_same_set(a, a)
        other = list(keys)
        change = rng.random()
        if change < 0.3 and other:
            other[rng.randrange(len(other))] = rng.randbytes(36)        # one key differs
        elif change < 0.5 and other:
            i = rng.randrange(len(other))
            other[i] = bytes(bytearray(other[i]))                       # equal, another object
        elif change < 0.7:
            rng.shuffle(other)                                          # another order
        elif change < 0.8 and other:
            other.pop()
        c = set(other)
        if _native.same_set(a, c):
            assert a == c and all(any(x is y for y in keys) for x in c)
        if change < 0.5 and other:
            assert not _native.same_set(a, c)
    grown = set(range(100))
    for i in range(90):
        grown.discard(i)                     # dummies: the same values, another table
    assert not _native.same_set(grown, set(range(90, 100)))
    assert _native.same_set(grown, grown) and not _native.same_set([1], [1])
    with pytest.raises(TypeError):
        _native.same_set(set())


def test_the_memory_fence_is_the_compiled_one_where_built():
    from kvd_proto import barrier

    assert barrier.fence() is None and barrier.py_fence() is None
    if native.NATIVE:                  # built, and not forced off (KVD_NATIVE=0)
        assert barrier.fence is _native.fence
