"""A reserve's top-up applied undecoded (kvd_proto/_grants.c and its twins in
kvd_proto/native.py): the compiled `granted_apply`, `kept_compact` and `list_discard` leave a
reserve's containers exactly as their Python twins do, on the GRANTED shapes the daemon writes
and on broken ones (refused alike, nothing changed); and `StoreReserve.granted_record` holds a
reserve exactly as decoding the record and calling `granted` does."""

from __future__ import annotations

import struct
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd_client.offload.reserve import StoreReserve
from kvd_proto import native
from kvd_proto import records as rec
from kvd_proto.wire import MAX_KEY_BYTES

compiled = pytest.mark.skipif(not native.NATIVE, reason="kvd_proto._native not built")
SLOT = 65536


def granted_payload(offsets: list[int], kept: list[tuple[int, bytes]] | None,
                    width: int = 32) -> bytes:
    """A GRANTED as the daemon writes it: offsets, then (with `kept`) the kept blocks'
    indices and fixed-width keys."""
    out = struct.pack(f"<I{len(offsets)}Q", len(offsets), *offsets)
    if kept is None:
        return out
    return out + struct.pack(f"<I{len(kept)}I", len(kept), *(i for i, _ in kept)) + \
        struct.pack("<IHH", len(kept), width, 0) + b"".join(key for _, key in kept)


def containers(n_held: int = 6) -> tuple[list[int], dict[bytes, int], dict[int, bytes]]:
    """A reserve's slots and kept blocks before a top-up: some held, some stale."""
    slots = [SLOT * (1000 + i) for i in range(n_held)]
    kept_at = {slots[0]: b"h" * 32, SLOT * 5: b"s" * 32}
    kept = {k: o for o, k in kept_at.items()}
    return slots, kept, kept_at


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


def snapshot(slots: list[int], kept: dict[bytes, int], kept_at: dict[int, bytes]
             ) -> tuple[list[int], list[tuple[bytes, int]], list[tuple[int, bytes]]]:
    """The containers, their order included (a dict's order decides which of two equal keys
    wins later)."""
    return list(slots), list(kept.items()), list(kept_at.items())


@compiled
@settings(max_examples=400, deadline=None)
@given(payloads())
def test_the_compiled_grant_leaves_the_containers_as_its_twin_does(payload):
    c_side, py_side = containers(), containers()
    assert native.granted_apply(payload, *c_side) == native.py_granted_apply(payload, *py_side)
    assert snapshot(*c_side) == snapshot(*py_side)


@settings(max_examples=300, deadline=None)
@given(payloads())
def test_a_grant_applied_undecoded_holds_the_reserve_as_the_decoded_one(payload):
    """`granted_record` (the session's path) against the record decoded and `granted`: the
    same slots, kept blocks and count of slots not replaced; a shape it leaves alone is left
    whole for the decoder (which reads it or refuses it)."""
    undecoded, decoded = StoreReserve(), StoreReserve()
    for reserve in (undecoded, decoded):
        reserve.slots[:], reserve.kept, reserve._kept_at = containers()
        reserve.took(9)
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
    assert snapshot(undecoded.slots, undecoded.kept, undecoded._kept_at) == \
        snapshot(decoded.slots, decoded.kept, decoded._kept_at)
    assert undecoded._unreplaced == decoded._unreplaced


def test_the_shapes_the_daemon_writes_are_taken_and_a_broken_one_changes_nothing():
    for apply in {native.granted_apply, native.py_granted_apply}:
        slots, kept, kept_at = containers(2)
        key = b"k" * 32
        assert apply(granted_payload([SLOT * 7, SLOT * 8], [(1, key)]), slots, kept,
                     kept_at) == 2
        assert slots[:2] == [SLOT * 7, SLOT * 8] and kept[key] == SLOT * 8 and \
            kept_at[SLOT * 8] == key
        assert kept[key] is slots[1]          # the very object: `list_discard` finds it so
        before = snapshot(slots, kept, kept_at)
        broken = granted_payload([SLOT * 9], [(1, key)])            # index past the offsets
        assert apply(broken, slots, kept, kept_at) is None
        assert apply(b"\x01\x00", slots, kept, kept_at) is None
        assert snapshot(slots, kept, kept_at) == before


@st.composite
def reserves(draw: st.DrawFn) -> tuple[list[int], dict[bytes, int], dict[int, bytes],
                                       deque[tuple[int, bytes]]]:
    """Slots, kept blocks (some of slots still held, some stale, some keys kept at two slots)
    and keys being taken back (negative in `kept`)."""
    offsets = [SLOT * i for i in range(draw(st.integers(0, 40)))]
    slots = draw(st.lists(st.sampled_from(offsets), unique=True)) if offsets else []
    keys = [bytes([i]) * 8 for i in range(12)]
    kept_at: dict[int, bytes] = {}
    for offset in draw(st.lists(st.sampled_from(offsets), unique=True)) if offsets else []:
        kept_at[offset] = draw(st.sampled_from(keys))
    kept = {k: o for o, k in kept_at.items()}
    restoring: deque[tuple[int, bytes]] = deque()
    for seq, key in enumerate(draw(st.lists(st.sampled_from(keys), max_size=5))):
        if draw(st.booleans()):
            kept[key] = -(seq + 1)
        restoring.append((seq, key))
    return slots, kept, kept_at, restoring


@compiled
@settings(max_examples=300, deadline=None)
@given(reserves())
def test_the_compiled_compaction_forgets_what_its_twin_forgets(reserve):
    slots, kept, kept_at, restoring = reserve
    c_kept, c_at = dict(kept), dict(kept_at)
    native.kept_compact(slots, c_kept, c_at, restoring)
    native.py_kept_compact(slots, kept, kept_at, restoring)
    assert list(c_kept.items()) == list(kept.items())
    assert list(c_at.items()) == list(kept_at.items())
    assert set(kept_at) <= set(slots)


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
    assert reserve.reclaim(stale, 3) is None and stale not in reserve.kept
    assert reserve.reclaim(key, 3) == SLOT * 1 and reserve.slots == []
    assert reserve.kept[key] == -4
    reserve.restored(3)
    assert key not in reserve.kept
