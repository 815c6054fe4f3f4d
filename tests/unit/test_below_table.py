"""The "held below" table (kvd_proto/below_layout.py): the daemon's writer
(kvd_server/tiers/below_table.py) and the engine's readers (kvd_proto._native.Lookups and its
Python twin) agree on every key through random adds and deletes; a lookup the index misses
goes to the fallback only for a key the table names (any key, while its flags say to ask the
cluster store); a file that is not a below table is
refused."""

from __future__ import annotations

import mmap
import os
import random

import pytest

from kvd_proto.below_layout import (
    FLAG_ASK,
    FLAG_WAIT,
    MAX_BUCKETS,
    MIN_BUCKETS,
    BelowHeader,
    buckets_for,
    fingerprint,
)
from kvd_proto.index_layout import Header
from kvd_proto.index_layout import buckets_for as index_buckets
from kvd_proto.native import PyLookups
from kvd_server.tiers.below_table import BelowTable

try:
    from kvd_proto import _native
except ImportError:                      # no compiler at install: the twins only
    _native = None

KINDS = [PyLookups] + ([_native.Lookups] if _native is not None else [])


def _reader_mapping(table: BelowTable) -> mmap.mmap:
    """The table as an engine maps it: read-only, through the descriptor handed over."""
    return mmap.mmap(table.fd, table.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ)


def _lookups(kind, fallback):
    return kind({}, "miss", "hit", fallback)


def test_fingerprints_are_the_same_compiled_and_in_python():
    rng = random.Random(5)
    keys = [b"", b"k"] + [rng.randbytes(rng.randrange(1, 300)) for _ in range(300)]
    if _native is not None:
        assert [_native.fingerprint(k) for k in keys] == [fingerprint(k) for k in keys]
    assert all(fingerprint(k) for k in keys)       # never 0: 0 is an empty bucket


def test_table_sizes_stay_within_their_bounds():
    assert buckets_for(0) == MIN_BUCKETS
    assert buckets_for(10_000) >= 15_000
    assert buckets_for(1 << 40) == MAX_BUCKETS


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__module__)
def test_readers_see_exactly_what_the_daemon_wrote_through_random_adds_and_deletes(kind):
    rng = random.Random(11)
    table = BelowTable("test", 2000)
    view = _reader_mapping(table)
    reader = _lookups(kind, lambda key: "fallback")
    reader.bind_below(view)
    held: set[bytes] = set()
    universe = [os.urandom(36) for _ in range(3000)]
    try:
        for step in range(20_000):
            key = rng.choice(universe)
            if rng.random() < 0.6:
                assert table.add(key)
                held.add(key)
            else:
                table.discard(key)
                held.discard(key)
            if step % 997 == 0:
                assert {k for k in universe if reader.below(k)} == held
                assert {k for k in universe if k in table} == held
        assert table.count == len(held)
        table.clear()
        assert not any(reader.below(k) for k in universe) and table.count == 0
    finally:
        reader.unbind()
        view.close()
        table.close()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__module__)
def test_an_index_miss_goes_to_the_fallback_only_for_a_key_held_below(kind):
    h = Header(capacity=16, buckets=index_buckets(16), key_width=40, per_extent=16,
               stride=8192, extent_bytes=16 * 8192)
    index = mmap.mmap(-1, h.file_bytes)
    index[:len(h.pack())] = h.pack()
    table = BelowTable("test", 100)
    asked: list[bytes] = []
    reader = _lookups(kind, lambda key: asked.append(key) or "pending")
    reader.bind(index, *h.geometry)
    reader.enabled = 1
    try:
        assert reader.lookup(b"below") == "miss"          # no table bound: the index decides
        view = _reader_mapping(table)
        reader.bind_below(view)
        table.add(b"below")
        assert reader.lookup(b"below") == "pending" and asked == [b"below"]
        assert reader.lookup(b"absent") == "miss"
        assert (reader.lookups, reader.misses) == (2, 2)  # the fallback counts its own
        # FLAG_ASK (the cluster store may hold any key): every index miss goes to the
        # fallback, which asks; the flags are read at each lookup, as the daemon changes them
        assert reader.below_flags() == 0
        table.flags = FLAG_ASK | FLAG_WAIT
        assert reader.below_flags() == FLAG_ASK | FLAG_WAIT
        assert reader.lookup(b"absent") == "pending" and asked[-1] == b"absent"
        table.flags = 0
        assert reader.lookup(b"absent") == "miss" and reader.below_flags() == 0
        reader.unbind_below()
        view.close()
        assert reader.lookup(b"below") == "miss" and reader.below_flags() == 0
    finally:
        reader.unbind()
        table.close()


def test_engines_cannot_write_the_table():
    table = BelowTable("test", 100)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(table.fd, table.file_bytes, mmap.MAP_SHARED,
                      mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        table.close()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__module__)
def test_a_file_that_is_not_a_below_table_is_refused(kind):
    reader = _lookups(kind, lambda key: None)
    bad = mmap.mmap(-1, 8192)
    with pytest.raises(ValueError):
        reader.bind_below(bad)                            # no magic
    short = mmap.mmap(-1, 4096 + 8 * MIN_BUCKETS)
    short[:24] = BelowHeader(2 * MIN_BUCKETS).pack()
    with pytest.raises(ValueError):
        reader.bind_below(short)                          # shorter than its buckets
    assert not reader.below(b"k")
