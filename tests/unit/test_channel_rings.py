"""A session's channel without a daemon (kvd_proto/channel.py): records go through both rings
in order and byte for byte, across the ring's end; the header is checked; and a side that
reads strictly (the daemon) turns every impossible position or length the other side could
write into a RingError instead of a wrong read, a hang or a crash."""

from __future__ import annotations

import mmap
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd_proto import native
from kvd_proto.channel import (
    DAEMON_IDLE,
    DOWN_HEAD,
    HEADER_BYTES,
    PAD,
    RECORD_HEADER,
    UP_HEAD,
    UP_TAIL,
    ChannelHeader,
    ChannelView,
    RingError,
    record,
)

SMALL = ChannelHeader(4096, 8192)


def mapped(header: ChannelHeader = SMALL) -> mmap.mmap:
    m = mmap.mmap(-1, header.file_bytes)
    m[:len(header.pack())] = header.pack()
    return m


def views(header: ChannelHeader = SMALL) -> tuple[ChannelView, ChannelView, mmap.mmap]:
    """(engine's view, daemon's view, the memory both map)."""
    m = mapped(header)
    return (ChannelView(memoryview(m), header, engine=True),
            ChannelView(memoryview(m), header, engine=False), m)


def drain(view: ChannelView) -> list[tuple[int, bytes]]:
    out = []
    while (item := view.reader.read()) is not None:
        out.append(item)
    view.reader.commit()
    return out


def test_a_header_round_trips_and_a_foreign_one_is_refused():
    assert ChannelHeader.unpack(SMALL.pack()) == SMALL
    assert SMALL.up_max_record == 1024 and SMALL.down_max_record == 2048
    assert SMALL.file_bytes == HEADER_BYTES + 4096 + 8192
    with pytest.raises(ValueError, match="not a kvd channel"):
        ChannelHeader.unpack(b"KVDIDX01" + SMALL.pack()[8:])
    with pytest.raises(ValueError, match="power of two"):
        ChannelHeader.unpack(ChannelHeader(4096 + 8, 8192).pack())
    with pytest.raises(ValueError, match="shorter"):
        ChannelHeader.unpack(b"KVD")


def test_records_go_up_and_down_in_order_and_are_read_after_publishing():
    engine, daemon, _ = views()
    assert engine.writer.write(record(5, b"first"))
    assert engine.writer.write(record(6, b""))
    assert drain(daemon) == []                           # not published yet
    engine.writer.publish()
    assert drain(daemon) == [(5, b"first"), (6, b"")]
    assert daemon.writer.write(record(1, b"answer"))
    daemon.writer.publish()
    assert drain(engine) == [(1, b"answer")]
    # The producer sees the consumer's head: all room is back.
    assert engine.writer.free() == 4096 and daemon.writer.free() == 8192


def test_a_record_never_wraps_a_filler_ends_the_ring():
    engine, daemon, m = views()
    big = record(3, bytes(range(200)) * 3)               # 608 bytes
    for _ in range(7):                                   # the 7th does not fit at 3648
        assert engine.writer.write(big)
        engine.writer.publish()
        assert drain(daemon) == [(3, bytes(range(200)) * 3)]
    assert engine.writer.tail == 7 * 608 + 448           # round, past a 448-byte filler
    length, kind, _ = RECORD_HEADER.unpack_from(m, HEADER_BYTES + 6 * 608)
    assert (length, kind) == (448, PAD)


def test_write_many_across_the_ring_end_puts_one_filler_and_says_where_each_record_ends():
    """A batch that crosses the end goes in whole (the records that fit, one filler, the rest
    from the start), with the same ends and bytes as one record at a time."""
    batch = [record(3, bytes([i]) * 592) for i in range(4)]     # 600 bytes each
    ends = {}
    streams = {}
    for how in ("many", "one"):
        engine, daemon, m = views()
        for size in [392] * 8 + [40]:                            # tail at 3248: 1 fits
            assert engine.writer.write(record(3, bytes(size)))
        engine.writer.publish()
        drain(daemon)
        if how == "many":
            ends[how] = engine.writer.write_many(batch)
        else:
            ends[how] = []
            for r in batch:
                assert engine.writer.write(r)
                ends[how].append(engine.writer.tail)
        engine.writer.publish()
        streams[how] = drain(daemon)
        assert engine.writer.tail == ends[how][-1]
    assert ends["many"] == ends["one"] == [3848, 4096 + 600, 4096 + 1200, 4096 + 1800]
    assert streams["many"] == streams["one"] == [(3, bytes([i]) * 592) for i in range(4)]


def test_a_full_ring_takes_nothing_until_the_consumer_reads():
    engine, daemon, _ = views()
    rec = record(2, bytes(1016))                          # 1024: the up ring's largest
    assert [engine.writer.write(rec) for _ in range(5)] == [True] * 4 + [False]
    engine.writer.publish()
    assert len(drain(daemon)) == 4
    assert engine.writer.write(rec)
    with pytest.raises(ValueError, match="does not fit"):
        engine.writer.write(record(2, bytes(1024)))      # over a quarter of the ring
    with pytest.raises(ValueError, match="does not fit"):
        engine.writer.write(b"\0" * 12)                  # not a multiple of 8


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 700)), min_size=1, max_size=60),
       st.integers(1, 7))
def test_write_many_is_the_same_stream_as_one_record_at_a_time(sizes, batch):
    """Any sizes, any batching, reads interleaved: the daemon reads exactly what was sent."""
    engine, daemon, _ = views()
    sent = [(kind, bytes([n % 251]) * n) for kind, n in sizes]
    records = [record(kind, payload) for kind, payload in sent]
    got: list[tuple[int, bytes]] = []
    i = 0
    for _ in range(10 * len(records) + 10):
        if i == len(records):
            break
        ends = engine.writer.write_many(records[i:i + batch])
        assert ends == sorted(ends) and (not ends or ends[-1] == engine.writer.tail)
        i += len(ends)
        engine.writer.publish()
        got += drain(daemon)
    got += drain(daemon)
    assert i == len(records) and got == sent


needs_native = pytest.mark.skipif(native.ring_write is None, reason="kvd_proto._native was "
                                  "not built (no C compiler or Python headers at install)")


@needs_native
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 700)), min_size=1, max_size=40),
       st.integers(1, 9), st.integers(0, 500).map(lambda x: 8 * x))
def test_the_compiled_append_and_read_all_are_the_python_loops(sizes, batch, start):
    """ring_write / ring_read (kvd_proto/_rings.c) against RingWriter._write_runs and
    RingReader.read: the same bytes in the ring, the same tails, heads and records, from any
    starting position (fillers included) and batching."""
    records = [record(kind, bytes([n % 251]) * n) for kind, n in sizes]
    rings, reads, tails = [], [], []
    for compiled in (True, False):
        engine, daemon, m = views()
        for writer, reader in ((engine.writer, daemon.reader),):
            writer.tail = writer.published = start          # as if `start` bytes went before
            struct.pack_into("<Q", m, UP_TAIL, start)
            struct.pack_into("<Q", m, UP_HEAD, start)
            reader.head = reader.committed = start
        got: list[tuple[int, bytes]] = []
        trail = []
        i = 0
        for _ in range(10 * len(records) + 10):
            if i == len(records):
                break
            part = records[i:i + batch]
            n = engine.writer.append(part) if compiled else len(engine.writer.write_many(part))
            trail.append((n, engine.writer.tail))
            i += n
            engine.writer.publish()
            if compiled:
                got += daemon.reader.read_all()
            else:
                while (item := daemon.reader.read()) is not None:
                    got.append(item)
            daemon.reader.commit()
        rings.append(bytes(m))
        reads.append(got)
        tails.append(trail)
    assert rings[0] == rings[1] and tails[0] == tails[1] and reads[0] == reads[1]
    assert [item for item in reads[0]] == [(k, bytes([n % 251]) * n) for k, n in sizes]


@pytest.mark.parametrize("compiled", [True, False])
@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 700), min_size=1, max_size=30), st.integers(0, 6),
       st.integers(0, 300).map(lambda x: 8 * x))
def test_read_all_with_a_limit_reads_that_many_in_order(compiled, sizes, limit, start):
    """The daemon reads a turn's records in batches no bigger than its answers have room for
    (kvd_server/channel/hub.py): read_all(limit) returns at most `limit` records, the next call
    goes on from there, fillers crossed as without a limit; compiled or the Python loop."""
    if compiled and native.ring_read is None:
        pytest.skip("kvd_proto._native is not built")
    engine, daemon, m = views()
    engine.writer.tail = engine.writer.published = start
    struct.pack_into("<Q", m, UP_TAIL, start)
    struct.pack_into("<Q", m, UP_HEAD, start)
    daemon.reader.head = daemon.reader.committed = start
    records = [record(1 + n % 9, bytes([n % 251]) * n) for n in sizes]
    sent = engine.writer.append(records) if native.ring_write is not None else \
        len(engine.writer.write_many(records))
    engine.writer.publish()
    ring_read = native.ring_read
    if not compiled:
        monkey = pytest.MonkeyPatch()
        monkey.setattr("kvd_proto.channel.ring_read", None)
    try:
        got: list[tuple[int, bytes]] = []
        for _ in range(len(records) + 2):
            batch = daemon.reader.read_all(limit)
            assert len(batch) <= limit
            if limit == 0:
                assert batch == []
                break
            if not batch:
                break
            got += batch
        if limit:
            assert got == [(1 + n % 9, bytes([n % 251]) * n) for n in sizes[:sent]]
            assert daemon.reader.read_all() == []
    finally:
        if not compiled:
            monkey.undo()
    assert native.ring_read is ring_read


@needs_native
def test_the_compiled_append_leaves_a_record_that_breaks_a_rule_to_the_python_path():
    engine, _, _ = views()
    with pytest.raises(ValueError, match="does not fit"):
        engine.writer.append([record(1, b"ok"), b"\0" * 12])
    assert engine.writer.tail == 0                          # the Python path raised first


def _publish_raw(m: mmap.mmap, tail: int, at: int, data: bytes) -> None:
    m[HEADER_BYTES + at:HEADER_BYTES + at + len(data)] = data
    struct.pack_into("<Q", m, UP_TAIL, tail)


@pytest.mark.parametrize("garbage", [
    "tail past the ring", "tail behind the head", "short record", "length zero",
    "length past the tail", "record over the limit", "filler not at the end",
])
def test_a_strict_reader_refuses_every_impossible_ring(garbage):
    _, daemon, m = views()
    if garbage == "tail past the ring":
        struct.pack_into("<Q", m, UP_TAIL, 4096 + 8)
    elif garbage == "tail behind the head":
        struct.pack_into("<Q", m, UP_TAIL, 2**64 - 8)
    elif garbage == "short record":
        _publish_raw(m, 4, 0, b"\x04\0\0\0")
    elif garbage == "length zero":
        _publish_raw(m, 8, 0, RECORD_HEADER.pack(0, 1, 0))
    elif garbage == "length past the tail":
        _publish_raw(m, 16, 0, RECORD_HEADER.pack(64, 1, 0) + bytes(8))
    elif garbage == "record over the limit":
        _publish_raw(m, 2048, 0, RECORD_HEADER.pack(2048, 1, 0))
    else:
        _publish_raw(m, 64, 0, RECORD_HEADER.pack(64, PAD, 0))
    with pytest.raises(RingError):
        daemon.reader.read()
    with pytest.raises(RingError):
        daemon.reader.read_all()


def test_a_strict_reader_returns_the_records_before_a_bad_one_then_refuses_it():
    engine, daemon, m = views()
    good = record(7, b"fine")
    assert engine.writer.write(good)
    at = len(good)
    m[HEADER_BYTES + at:HEADER_BYTES + at + 8] = RECORD_HEADER.pack(0, 1, 0)   # length zero
    struct.pack_into("<Q", m, UP_TAIL, at + 8)
    assert daemon.reader.read_all() == [(7, b"fine")]
    with pytest.raises(RingError):
        daemon.reader.read_all()


def test_a_lenient_reader_reads_nothing_from_garbage_and_a_strict_writer_refuses_it():
    engine, daemon, m = views()
    struct.pack_into("<Q", m, DOWN_HEAD, 10**6)          # the engine's head: garbage
    with pytest.raises(RingError):
        daemon.writer.free()
    struct.pack_into("<Q", m, UP_HEAD, 10**6)            # the daemon's head: the engine
    assert engine.writer.free() == 0                     # trusts it, writes nothing
    assert not engine.writer.write(record(1, b""))


def test_the_idle_flag_is_the_daemons_word():
    engine, daemon, m = views()
    assert not engine.daemon_idle
    daemon.set_daemon_idle(True)
    assert engine.daemon_idle and struct.unpack_from("<Q", m, DAEMON_IDLE)[0] == 1
    daemon.set_daemon_idle(False)
    assert not engine.daemon_idle


def test_the_documented_layout_and_record_kinds_are_the_codes():
    """docs/attach.md is what a client in another language is written from."""
    import pathlib
    import re

    from kvd_proto import records as rec
    from kvd_proto.channel import DOWN_TAIL, UP_HEAD

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "attach.md").read_text()
    section = doc.split("## The channel", 1)[1].split("## Warm restart", 1)[0]
    for name, offset in (("UP_TAIL", UP_TAIL), ("UP_HEAD", UP_HEAD), ("DOWN_TAIL", DOWN_TAIL),
                         ("DOWN_HEAD", DOWN_HEAD), ("DAEMON_IDLE", DAEMON_IDLE)):
        assert f"{name} @{offset}" in section, name
    up, down = section.split("| kind | down record", 1)
    rows = {int(k): n for k, n in re.findall(r"^\| (\d+) \| ([A-Z_]+)", up, re.M)}
    assert {k: n.lower() for k, n in rows.items()} == rec.UP_KINDS
    rows = {int(k): n for k, n in re.findall(r"^\| (\d+) \| ([A-Z_]+)", down, re.M)}
    assert {k: n.lower() for k, n in rows.items()} == rec.DOWN_KINDS
