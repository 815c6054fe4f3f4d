"""A reserve's top-up applied undecoded and its kept blocks (kvd_proto/_grants.c and its
twins in kvd_proto/native.py): the compiled `KeptTable` answers and holds exactly what its
Python twin does over random operations and on the GRANTED shapes the daemon writes and broken
ones (refused alike, nothing changed); `list_discard` removes as list.remove does; and
`StoreReserve.granted_record` holds a reserve exactly as decoding the record and calling
`granted` does."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd_client.offload.reserve import StoreReserve
from kvd_proto import native
from kvd_proto import records as rec
from kvd_proto.wire import MAX_KEY_BYTES

compiled = pytest.mark.skipif(not native.NATIVE, reason="kvd_proto._native not built")
SLOT = 65536
TABLES = [native.PyKeptTable] + ([native._native.KeptTable] if native.NATIVE else [])


def granted_payload(offsets: list[int], kept: list[tuple[int, bytes]] | None,
                    width: int = 32) -> bytes:
    """A GRANTED as the daemon writes it: offsets, then (with `kept`) the kept blocks'
    indices and fixed-width keys."""
    out = struct.pack(f"<I{len(offsets)}Q", len(offsets), *offsets)
    if kept is None:
        return out
    return out + struct.pack(f"<I{len(kept)}I", len(kept), *(i for i, _ in kept)) + \
        struct.pack("<IHH", len(kept), width, 0) + b"".join(key for _, key in kept)


def filled(table_type, n_held: int = 6):
    """A reserve's slots and kept blocks before a top-up: one held slot's, one taken back."""
    slots = [SLOT * (1000 + i) for i in range(n_held)]
    table = table_type()
    table.put(b"h" * 32, slots[0])
    table.put(b"r" * 32, -3)
    return slots, table


def snapshot(slots: list[int], table) -> tuple[list[int], list[tuple[bytes, int]]]:
    return list(slots), sorted(table.items())


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    """Well-formed GRANTEDs of both shapes, and broken ones (cut short, a byte changed, an
    index out of range, counts that disagree)."""
    count = draw(st.integers(0, 12))
    offsets = [SLOT * draw(st.integers(0, 4000)) for _ in range(count)]
    width = draw(st.sampled_from([1, 16, 32, MAX_KEY_BYTES]))
    kept = None
    if draw(st.booleans()):
        chosen = draw(st.lists(st.integers(0, max(0, count - 1)), max_size=count,
                               unique=True)) if count else []
        kept = [(i, draw(st.binary(min_size=width, max_size=width))) for i in chosen]
    data = granted_payload(offsets, kept, width)
    how = draw(st.sampled_from(["whole", "whole", "cut", "flip", "extra", "index", "zero"]))
    if how == "cut" and data:
        data = data[:draw(st.integers(0, len(data) - 1))]
    elif how == "flip" and data:
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1:]
    elif how == "extra":
        data += draw(st.binary(min_size=1, max_size=9))
    elif how == "index" and kept:
        at = 4 + 8 * count + 4
        data = data[:at] + struct.pack("<I", count + draw(st.integers(0, 5))) + data[at + 4:]
    elif how == "zero" and kept is not None:
        at = 4 + 8 * count + 4 + 4 * len(kept) + 6
        data = data[:at] + struct.pack("<H", 1) + data[at + 2:]
    return data


@compiled
@settings(max_examples=400, deadline=None)
@given(payloads())
def test_the_compiled_grant_leaves_the_reserve_as_its_twin_does(payload):
    c_side, py_side = filled(native._native.KeptTable), filled(native.PyKeptTable)
    assert c_side[1].apply(payload, c_side[0]) == py_side[1].apply(payload, py_side[0])
    assert snapshot(*c_side) == snapshot(*py_side)


KEYS = [bytes([i]) * w for i in range(6) for w in (1, 8, 32, 100)]   # 100: a wider stride
OFFSETS = [SLOT * i for i in range(8)] + [0]


@st.composite
def operations(draw: st.DrawFn) -> list[tuple]:
    """Random puts (offsets and values taken back, keys and offsets reused), gets, pops,
    discards, clears, and bad arguments."""
    ops = []
    for _ in range(draw(st.integers(0, 120))):
        kind = draw(st.sampled_from(["put", "put", "put", "putneg", "get", "pop", "in",
                                     "discard", "clear", "bad"]))
        key = draw(st.sampled_from(KEYS))
        if kind == "put":
            ops.append(("put", key, draw(st.sampled_from(OFFSETS))))
        elif kind == "putneg":
            ops.append(("put", key, -draw(st.integers(1, 9))))
        elif kind == "discard":
            ops.append(("discard", draw(st.lists(st.sampled_from(OFFSETS + [-1]),
                                                 max_size=4))))
        elif kind == "bad":
            ops.append(draw(st.sampled_from([("put", "text", 1), ("put", key, 1.5),
                                             ("put", b"x" * 129, 1), ("get", 7),
                                             ("put", key, 1 << 64), ("discard", ["a"])])))
        else:
            ops.append((kind, key))
    return ops


def run(table, ops: list[tuple]) -> list:
    out = []
    for op in ops:
        try:
            if op[0] == "put":
                out.append(table.put(op[1], op[2]))
            elif op[0] == "get":
                out.append(table.get(op[1]))
            elif op[0] == "pop":
                out.append(table.pop(op[1]))
            elif op[0] == "in":
                out.append(op[1] in table)
            elif op[0] == "discard":
                out.append(table.discard_offsets(op[1]))
            else:
                out.append(table.clear())
        except (TypeError, ValueError, OverflowError) as exc:
            out.append(type(exc).__name__)
        out.append((len(table), sorted(table.items())))
    return out


@compiled
@settings(max_examples=300, deadline=None)
@given(operations())
def test_the_compiled_table_answers_as_its_twin_does(ops):
    assert run(native._native.KeptTable(), ops) == run(native.PyKeptTable(), ops)


@compiled
def test_the_compiled_table_grows_and_shrinks_and_keeps_every_entry():
    """Thousands of entries (the table grows past its first buckets), half of them gone by
    their offsets, the rest still found: deletions leave no entry unreachable."""
    c, py = native._native.KeptTable(), native.PyKeptTable()
    for table in (c, py):
        for i in range(5000):
            table.put(i.to_bytes(16, "little"), SLOT * i)
        table.discard_offsets([SLOT * i for i in range(0, 5000, 2)])
        for i in range(0, 5000, 3):
            table.put(i.to_bytes(16, "little"), -(i + 1))
    assert sorted(c.items()) == sorted(py.items()) and len(c) == len(py)
    for i in range(5000):
        key = i.to_bytes(16, "little")
        assert c.get(key) == py.get(key)


@compiled
@settings(max_examples=40, deadline=None)
@given(st.data())
def test_large_grants_and_discards_in_batches_match_the_twin(data):
    """GRANTEDs of hundreds of kept blocks (the compiled apply puts them CHUNK at a time, the
    room for all made first), keys and offsets repeated within one, then discards of many
    offsets, one not an int in the middle (those before it go, as in the twin)."""
    sides = [([], native._native.KeptTable()), ([], native.PyKeptTable())]
    for _ in range(data.draw(st.integers(1, 4))):
        count = data.draw(st.integers(1, 400))
        offsets = [SLOT * data.draw(st.integers(0, 600)) for _ in range(count)]
        kept = [(i, data.draw(st.sampled_from([b"a", b"b"])) * 16 + i.to_bytes(16, "little")
                 if data.draw(st.booleans()) else b"same" * 8) for i in range(count)]
        payload = granted_payload(offsets, kept)
        assert sides[0][1].apply(payload, sides[0][0]) == sides[1][1].apply(payload, sides[1][0])
        assert snapshot(*sides[0]) == snapshot(*sides[1])
        drop = data.draw(st.lists(st.sampled_from(offsets + [-1]), max_size=100))
        if drop and data.draw(st.booleans()):
            drop.insert(data.draw(st.integers(0, len(drop))), "bad")
        answers = []
        for _, table in sides:
            try:
                answers.append(table.discard_offsets(drop))
            except TypeError as exc:
                answers.append(type(exc).__name__)
        assert answers[0] == answers[1]
        assert snapshot(*sides[0]) == snapshot(*sides[1])


@settings(max_examples=300, deadline=None)
@given(payloads())
def test_a_grant_applied_undecoded_holds_the_reserve_as_the_decoded_one(payload):
    """`granted_record` (the session's path) against the record decoded and `granted`: the
    same slots, kept blocks and count of slots not replaced; a shape it leaves alone is left
    whole for the decoder (which reads it or refuses it)."""
    undecoded, decoded = StoreReserve(), StoreReserve()
    for reserve in (undecoded, decoded):
        reserve.slots[:] = [SLOT * (1000 + i) for i in range(6)]
        slots = reserve.slots
        reserve.kept.put(b"h" * 32, slots[0])
        reserve.kept.put(b"r" * 32, -3)
        reserve.took(reserve.slots[-2:])
        del reserve.slots[-2:]
    taken = undecoded.granted_record(payload)
    try:
        answer = rec.decode_down(rec.GRANTED, payload)
    except rec.RecordError:
        answer = None
    if taken:
        assert isinstance(answer, rec.Granted)
    if isinstance(answer, rec.Granted):
        decoded.granted(answer.offsets, answer.kept_index, answer.kept_keys)
        if not taken:          # a shape only the checked decoder reads: the caller's part
            undecoded.granted(answer.offsets, answer.kept_index, answer.kept_keys)
    assert snapshot(undecoded.slots, undecoded.kept) == snapshot(decoded.slots, decoded.kept)
    assert undecoded._unreplaced == decoded._unreplaced


def test_the_shapes_the_daemon_writes_are_taken_and_a_broken_one_changes_nothing():
    for table_type in TABLES:
        slots, kept = filled(table_type, 2)
        key = b"k" * 32
        assert kept.apply(granted_payload([SLOT * 7, SLOT * 8], [(1, key)]), slots) == 2
        assert slots[:2] == [SLOT * 7, SLOT * 8] and kept.get(key) == SLOT * 8
        assert kept.get(key) is slots[1]          # the very object: `list_discard` finds it so
        before = snapshot(slots, kept)
        broken = granted_payload([SLOT * 9], [(1, key)])            # index past the offsets
        assert kept.apply(broken, slots) is None
        assert kept.apply(b"\x01\x00", slots) is None
        assert kept.apply(granted_payload([1 << 63], [(0, key)]), slots) is None
        assert snapshot(slots, kept) == before
        # A slot granted again with another block: the old block's entry goes.
        assert kept.apply(granted_payload([SLOT * 8], [(0, b"n" * 32)]), slots) == 1
        assert key not in kept and kept.get(b"n" * 32) == SLOT * 8


@compiled
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), unique=True), st.integers(0, 60), st.booleans())
def test_discarding_from_a_list_matches_list_remove(values, value, same_object):
    items = [SLOT * v for v in values]
    obj = items[values.index(value)] if same_object and value in values else SLOT * value
    c_items, py_items = list(items), list(items)
    assert native.list_discard(c_items, obj) == native.py_list_discard(py_items, obj)
    assert c_items == py_items


def test_a_kept_block_is_taken_back_and_a_stale_one_forgotten():
    """`reclaim` through `list_discard`: a held kept slot leaves the reserve once; one whose
    slot was stored into answers None and is forgotten."""
    reserve = StoreReserve()
    key, stale = b"a" * 32, b"b" * 32
    assert reserve.granted_record(granted_payload([SLOT * 1, SLOT * 2], [(0, key), (1, stale)]))
    assert reserve.take(1) == [SLOT * 2]                  # the oldest granted: stale's slot
    assert stale not in reserve.kept                      # gone with its slot
    assert reserve.reclaim(stale, 3) is None
    assert reserve.reclaim(key, 3) == SLOT * 1 and reserve.slots == []
    assert reserve.kept.get(key) == -4
    reserve.restored(3)
    assert key not in reserve.kept
