"""The channel's records (kvd_proto/records.py): every kind decodes to what was encoded, and a
record that breaks the encoding or a bound is refused with a message that names the field;
random bytes never raise anything else (the daemon decodes what any engine wrote)."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd_proto import native
from kvd_proto import records as rec
from kvd_proto.channel import RECORD_HEADER
from kvd_proto.wire import (
    MAX_GRANTED_SLOTS,
    MAX_KEY_BYTES,
    MAX_KEYS_PER_CALL,
    MAX_STRING_BYTES,
)

KEYS = [bytes([i]) * 36 for i in range(5)]
MIXED = [b"a", b"bb" * 30, bytes(range(128)), b"ccc"]


def roundtrip_up(data: bytes) -> rec.UpRecord:
    length, kind, _ = RECORD_HEADER.unpack_from(data)
    return rec.decode_up(kind, data[RECORD_HEADER.size:length])


def roundtrip_down(data: bytes) -> rec.DownRecord:
    length, kind, _ = RECORD_HEADER.unpack_from(data)
    return rec.decode_down(kind, data[RECORD_HEADER.size:length])


@pytest.mark.parametrize("keys", [KEYS, MIXED, []], ids=["fixed-width", "mixed", "none"])
def test_every_up_record_decodes_to_what_was_encoded(keys):
    positions = list(range(10, 10 + len(keys))) or None     # none: encoded as "no positions"
    granted = [(i, 4096 * (i + 1)) for i in range(0, len(keys), 2)]
    index, offsets_ = [i for i, _ in granted], [o for _, o in granted]
    assert roundtrip_up(rec.encode_store(keys, "req-1", positions, index, offsets_)) == \
        rec.Store("req-1", keys, positions, [keys[i] for i in index], offsets_)
    assert roundtrip_up(rec.encode_store(keys, "", None, [], [])) == \
        rec.Store("", keys, None, [], [])
    assert roundtrip_up(rec.encode_complete_store(keys, False, "r", 7)) == \
        rec.CompleteStore(keys, False, "r", 7)
    offsets = [8192 * i for i in range(len(keys))]
    assert roundtrip_up(rec.encode_pin(keys, "rq", positions, offsets)) == \
        rec.Pin(keys, "rq", positions, offsets)
    assert roundtrip_up(rec.encode_complete_load(keys, "rq", 3)) == \
        rec.CompleteLoad(keys, "rq", 3)
    assert roundtrip_up(rec.encode_touch(keys, "ü")) == rec.Touch(keys, "ü")
    assert roundtrip_up(rec.encode_request_finished("r9")) == rec.RequestFinished("r9")
    assert roundtrip_up(rec.encode_reserve(300, True)) == rec.Reserve(300, True)
    assert roundtrip_up(rec.encode_reset(2**63)) == rec.Reset(2**63)
    assert roundtrip_up(rec.encode_take_events(5)) == rec.TakeEvents(5)
    assert roundtrip_up(rec.encode_counters(9, 4, 5)) == rec.Counters(9, 4, 5)
    assert roundtrip_up(rec.encode_release_held("s1-ab")) == rec.ReleaseHeld("s1-ab")
    assert roundtrip_up(rec.encode_return_slots(offsets)) == rec.ReturnSlots(offsets)
    assert roundtrip_up(rec.encode_find(2**40, keys)) == rec.Find(2**40, keys)


def test_every_down_record_decodes_to_what_was_encoded():
    assert roundtrip_down(rec.encode_granted([0, 4096])) == rec.Granted([0, 4096])
    assert roundtrip_down(rec.encode_reset_done(3, 4, 5)) == rec.ResetDone(3, 4, 5)
    events = [(tuple(KEYS), False, False), (tuple(MIXED), True, True), ((), True, False)]
    assert roundtrip_down(rec.encode_events(events, True)) == rec.Events(events, True)
    assert roundtrip_down(rec.encode_rejected(rec.PIN, "INVALID_ARGUMENT", "x" * 999)) == \
        rec.Rejected(rec.PIN, "INVALID_ARGUMENT", "x" * 256)
    assert roundtrip_down(rec.encode_found(17)) == rec.Found(17)
    with pytest.raises(rec.RecordError, match="unknown answer kind"):
        rec.decode_down(99, b"")


def _payload(data: bytes) -> bytes:
    length, _, _ = RECORD_HEADER.unpack_from(data)
    return data[RECORD_HEADER.size:length]


def _keys_field(n: int, width: int, body: bytes = b"") -> bytes:
    return struct.pack("<IHH", n, width, 0) + body


@pytest.mark.parametrize("kind, payload, field", [
    (77, b"", "unknown record kind"),
    (rec.REQUEST_FINISHED, b"\x05\x00ab", "req_id runs past"),
    (rec.REQUEST_FINISHED, struct.pack("<H", 300) + b"x" * 300, "more than 256"),
    (rec.REQUEST_FINISHED, b"\x02\x00\xff\xfe", "not UTF-8"),
    (rec.REQUEST_FINISHED, b"\x00\x00extra", "left over"),
    (rec.TOUCH, b"\0\0" + _keys_field(MAX_KEYS_PER_CALL + 1, 1), "MAX_KEYS_PER_CALL"),
    (rec.TOUCH, b"\0\0" + _keys_field(1, MAX_KEY_BYTES + 1), "key width"),
    (rec.TOUCH, b"\0\0" + _keys_field(2, 0, b"\x01\x00ab"), "empty key"),
    (rec.TOUCH, b"\0\0" + _keys_field(2, 1, b"aa"), "names a key twice"),
    (rec.TOUCH, b"\0\0" + _keys_field(3, 4, b"abc"), "keys runs past"),
    (rec.RESERVE, struct.pack("<II", MAX_GRANTED_SLOTS + 1, 0), "MAX_GRANTED_SLOTS"),
    (rec.RESERVE, struct.pack("<II", 1, 4), "unknown flags"),
    (rec.COUNTERS, struct.pack("<QQQ", 1, 1, 1), "are not lookups"),
    (rec.COMPLETE_STORE, struct.pack("<QB", 0, 2), "success is 2"),
    (rec.TAKE_EVENTS, struct.pack("<I", 10**6), "max_events"),
    (rec.RETURN_SLOTS, struct.pack("<I", MAX_GRANTED_SLOTS + 1), "return_slots"),
])
def test_a_broken_record_is_refused_naming_what_is_wrong(kind, payload, field):
    with pytest.raises(rec.RecordError, match=field):
        rec.decode_up(kind, payload)


def test_a_store_naming_a_slot_for_a_key_it_did_not_offer_is_refused():
    good = _payload(rec.encode_store(KEYS[:2], "r", None, [0, 1], [0, 4096]))
    # one granted index past the offered keys, then one named twice
    past = good[:-24] + struct.pack("<II", 0, 2) + good[-16:]
    with pytest.raises(rec.RecordError, match="outside the offered keys"):
        rec.decode_up(rec.STORE, past)
    twice = good[:-24] + struct.pack("<II", 1, 1) + good[-16:]
    with pytest.raises(rec.RecordError, match="named twice"):
        rec.decode_up(rec.STORE, twice)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(rec.UP_KINDS) + [0, 13, 65535]), st.binary(max_size=300))
def test_random_bytes_are_a_record_or_a_record_error(kind, payload):
    with contextlib.suppress(rec.RecordError):       # anything else fails the test
        rec.decode_up(kind, payload)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=MAX_KEY_BYTES), max_size=40, unique=True),
       st.text(max_size=40))
def test_any_keys_and_request_round_trip(keys, req_id):
    assert roundtrip_up(rec.encode_touch(keys, req_id)) == rec.Touch(keys, req_id)


@given(st.text(max_size=300))
def test_a_request_finished_is_the_generic_record_of_its_id(req_id):
    """The step's end encodes REQUEST_FINISHED in one pack (records.py): the same bytes as
    the generic record of a length-prefixed string, padded."""
    from kvd_proto.channel import record

    data = req_id.encode()
    assert rec.encode_request_finished(req_id) == \
        record(rec.REQUEST_FINISHED, struct.pack("<H", len(data)) + data)


def test_a_grant_reads_back_and_a_torn_one_is_refused():
    """GRANTED, the common answer, has its own short path in decode_down: the same offsets,
    and a count that does not match the payload, or an offset past 2^63 (which the compiled
    apply refuses too), is still a RecordError."""
    data = rec.encode_granted([0, 4096, 2**62 + 8])
    length = int.from_bytes(data[:4], "little")
    payload = data[8:length]
    assert rec.decode_down(rec.GRANTED, payload) == rec.Granted([0, 4096, 2**62 + 8])
    past = rec.encode_granted([0, 2**63 + 8])        # no pool offset is that large (int64)
    with pytest.raises(rec.RecordError, match="past 2\\^63"):
        rec.decode_down(rec.GRANTED, past[8:int.from_bytes(past[:4], "little")])
    assert rec.decode_down(rec.GRANTED, rec.encode_granted([])[8:12]) == rec.Granted([])
    for torn in (payload[:-8], payload + bytes(8), payload[:3], (7).to_bytes(4, "little")):
        with pytest.raises(rec.RecordError):
            rec.decode_down(rec.GRANTED, torn)


# --- the compiled decoder of the keyed records (kvd_proto/_decode.c) --------------------------

KEYED = (rec.STORE, rec.COMPLETE_STORE, rec.PIN, rec.COMPLETE_LOAD)
needs_decoder = pytest.mark.skipif(native.decode_keyed is None,
                                   reason="kvd_proto._native is not built")


def compiled(kind: int, payload: bytes) -> tuple | None:
    return native.decode_keyed(kind, payload, MAX_STRING_BYTES, MAX_KEYS_PER_CALL,
                               MAX_KEY_BYTES)


def checked(kind: int, payload: bytes) -> rec.UpRecord | None:
    try:
        return rec.decode_up_checked(kind, payload)
    except rec.RecordError:
        return None


def agree(kind: int, payload: bytes, *, valid: bool = False) -> None:
    """The compiled decoder accepts only what the Python one accepts, with the same fields
    (same types too), and every well-formed record (`valid`)."""
    fast, slow = compiled(kind, payload), checked(kind, payload)
    if fast is None:
        assert not valid, "the compiled decoder refused a well-formed record"
        return
    assert slow is not None, "the compiled decoder accepted a record Python refuses"
    assert fast == tuple(slow)
    assert [type(f) for f in fast] == [type(f) for f in slow]
    assert rec.decode_up(kind, payload) == slow


def keyed_payloads(keys: list[bytes], req_id: str, positions: list[int] | None,
                   every: int) -> list[bytes]:
    index = list(range(0, len(keys), every))
    offsets = [4096 * (i + 1) for i in index]
    return [_payload(r) for r in (
        rec.encode_store(keys, req_id, positions, index, offsets),
        rec.encode_complete_store(keys, bool(every % 2), req_id, 2**64 - every),
        rec.encode_pin(keys, req_id, positions, [8192 * i for i in range(len(keys))]),
        rec.encode_complete_load(keys, req_id, every))]


@needs_decoder
@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=MAX_KEY_BYTES), max_size=40, unique=True),
       st.text(max_size=60), st.booleans(), st.integers(1, 4), st.data())
def test_the_compiled_decoder_is_the_python_one(keys, req_id, with_positions, every, data):
    if len(req_id.encode()) > MAX_STRING_BYTES:
        req_id = req_id[:10]
    if data.draw(st.booleans()) and keys:               # fixed width, as vLLM's keys are
        keys = list(dict.fromkeys(k.ljust(36, b".")[:36] for k in keys))
    positions = [data.draw(st.integers(-2**63, 2**63 - 1)) for _ in keys] \
        if with_positions and keys else None
    for kind, payload in zip(KEYED, keyed_payloads(keys, req_id, positions, every),
                             strict=True):
        agree(kind, payload, valid=True)
        # Corrupted: a byte changed, cut short, one byte more; other kinds' payloads.
        at = data.draw(st.integers(0, max(0, len(payload) - 1)))
        if payload:
            agree(kind, payload[:at] + bytes([payload[at] ^ data.draw(st.integers(1, 255))])
                  + payload[at + 1:])
        agree(kind, payload[:at])
        agree(kind, payload + b"\0")
        for other in KEYED:
            agree(other, payload)


@needs_decoder
@settings(max_examples=400, deadline=None)
@given(st.sampled_from(KEYED), st.binary(max_size=300))
def test_the_compiled_decoder_refuses_what_python_refuses(kind, payload):
    agree(kind, payload)


@needs_decoder
def test_the_compiled_decoder_refuses_each_broken_rule():
    keys = [b"k" * 36, b"j" * 36]
    store = _payload(rec.encode_store(keys, "r", [1, 2], [0, 1], [0, 4096]))
    assert compiled(rec.STORE, store) is not None
    twice = _payload(rec.encode_store([keys[0], keys[0]], "r", None, [], []))
    bad_text = _payload(rec.encode_complete_load(keys, "r", 1))
    bad_text = bad_text[:8] + struct.pack("<H", 1) + b"\xff" + bad_text[11:]
    for kind, payload in ((rec.STORE, twice), (rec.STORE, store[:-1]),
                          (rec.STORE, store[:-24] + struct.pack("<II", 0, 2) + store[-16:]),
                          (rec.STORE, store[:-24] + struct.pack("<II", 1, 1) + store[-16:]),
                          (rec.COMPLETE_LOAD, bad_text), (rec.TOUCH, store),
                          (rec.COMPLETE_STORE, struct.pack("<QB", 0, 2))):
        assert compiled(kind, payload) is None
        with pytest.raises(rec.RecordError):
            rec.decode_up(kind, payload)


@pytest.mark.parametrize("kept", [([], []), ([0, 2], [b"a" * 36, b"b" * 36]), ([1], [b"ab"]),
                                  ([0, 1], [b"a", b"bc"])])
def test_granted_with_its_kept_blocks_decodes_alike_on_the_quick_path_and_the_checked_one(kept):
    index, keys = kept
    record_bytes = rec.encode_granted([8, 16, 24], index, keys)
    length, kind, _ = struct.unpack_from("<IHH", record_bytes)
    payload = record_bytes[8:length]
    out = rec.decode_down(kind, payload)
    assert (list(out.offsets), list(out.kept_index), list(out.kept_keys)) == \
        ([8, 16, 24], index, keys)
    for cut in range(len(payload)):                     # cut short: refused, never misread
        try:
            short = rec.decode_down(kind, payload[:cut])
        except rec.RecordError:
            continue
        assert list(short.kept_keys) in ([], keys[:len(short.kept_keys)])
        assert set(short.kept_index) <= set(range(len(short.offsets)))


def test_a_hint_round_trips_and_one_without_a_request_is_refused():
    assert roundtrip_up(rec.encode_hint("req-1", "agent-7", 300_000)) == \
        rec.Hint("req-1", "agent-7", 300_000)
    one = rec.decode_up_checked(rec.HINT, rec._str("r") + rec._str("") + b"\0\0\0\0")
    assert one == rec.Hint("r", "", 0)
    with pytest.raises(rec.RecordError, match="req_id is empty"):
        rec.decode_up_checked(rec.HINT, rec._str("") + rec._str("s") + b"\0\0\0\0")
    with pytest.raises(rec.RecordError):
        rec.decode_up_checked(rec.HINT, rec._str("r") + rec._str("s") + b"\0\0")
