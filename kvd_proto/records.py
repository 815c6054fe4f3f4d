"""The records a session's channel carries (kvd_proto/channel.py), version 1: what each kind
holds and its encoding. The same operations as the StepStream ops of kvd.proto's shared-index
protocol (StoreGranted, Pin, Grant, ...), with the same bounds, in fixed binary fields so that
the engine's scheduler thread can write them cheaply and any language can read them.

Payload fields, little-endian, in order (docs/attach.md, "The channel", has the table):
  str     u16 length + UTF-8 bytes (at most MAX_STRING_BYTES)
  keys    u32 count, u16 width, u16 0; width > 0: count x width bytes (every key that long);
          width 0: count x u8 lengths, then the keys' bytes back to back
  i64s / u64s / u32s   count values (the count is stated by a field before them)

The daemon decodes up records strictly (`decode_up` raises RecordError with a message that
names the field); a rejected record is answered with a REJECTED record and skipped.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from typing import NamedTuple

from kvd_proto.channel import ALIGN, RECORD_HEADER, record
from kvd_proto.native import decode_keyed, granted_shape, keys_block, keys_record
from kvd_proto.record_kinds import (
    COMPLETE_LOAD,
    COMPLETE_STORE,
    COUNTERS,
    DOWN_KINDS,
    EVENTS,
    FIND,
    FOUND,
    GRANTED,
    HINT,
    PIN,
    PROMOTE,
    REJECTED,
    RELEASE_HELD,
    REQUEST_FINISHED,
    RESERVE,
    RESET,
    RESET_DONE,
    RESTORE,
    RETURN_SLOTS,
    STORE,
    TAKE_EVENTS,
    TOUCH,
    UP_KINDS,
)
from kvd_proto.wire import (
    MAX_EVENTS,
    MAX_GRANTED_SLOTS,
    MAX_KEY_BYTES,
    MAX_KEYS_PER_CALL,
    MAX_STRING_BYTES,
)

MAX_COUNTER_DELTA = 1 << 40
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_KEYS = struct.Struct("<IHH")
_COUNTERS = struct.Struct("<QQQ")
_RESET_DONE = struct.Struct("<QQQ")
_EPOCH_FLAG = struct.Struct("<QB")
_FINISHED_HEAD = struct.Struct(RECORD_HEADER.format + "H")   # a REQUEST_FINISHED to its id
_ZEROS = tuple(bytes(n) for n in range(ALIGN))


class RecordError(ValueError):
    """A record that breaks the encoding or a bound (INVALID_ARGUMENT)."""


# --- encoding ---------------------------------------------------------------------------------


def _str(value: str) -> bytes:
    data = value.encode()
    return _U16.pack(len(data)) + data


_keys = keys_block       # compiled where built (kvd_proto/native.py)
# The records that carry keys (one per offload call), in one pass where compiled.
_keys_record = keys_record


def encode_store(keys: Sequence[bytes], req_id: str, positions: Sequence[int] | None,
                 index: Sequence[int], offsets: Sequence[int]) -> bytes:
    """`index[i]`: the position in `keys` of a key stored into the granted slot at
    `offsets[i]`."""
    if len(offsets) != len(index):
        raise ValueError("one granted slot per stored key")
    return _keys_record(STORE, b"", req_id, keys, True, positions, index, offsets)


def encode_complete_store(keys: Sequence[bytes], success: bool, req_id: str,
                          epoch: int) -> bytes:
    return _keys_record(COMPLETE_STORE, _EPOCH_FLAG.pack(epoch, success), req_id, keys, False,
                        None, None, None)


def encode_pin(keys: Sequence[bytes], req_id: str, positions: Sequence[int] | None,
               offsets: Sequence[int]) -> bytes:
    if len(offsets) != len(keys):
        raise ValueError("one slot per pinned key")
    return _keys_record(PIN, b"", req_id, keys, True, positions, None, offsets)


def encode_complete_load(keys: Sequence[bytes], req_id: str, epoch: int) -> bytes:
    return _keys_record(COMPLETE_LOAD, _U64.pack(epoch), req_id, keys, False, None, None, None)


def encode_touch(keys: Sequence[bytes], req_id: str) -> bytes:
    return record(TOUCH, _str(req_id) + _keys(keys))


def encode_request_finished(req_id: str) -> bytes:
    """`record(REQUEST_FINISHED, _str(req_id))` in one pack and one join: the scheduler
    encodes one for every request that ends (tests/unit/test_records.py holds the two equal)."""
    data = req_id.encode()
    n = _FINISHED_HEAD.size + len(data)
    return _FINISHED_HEAD.pack(n, REQUEST_FINISHED, 0, len(data)) + data + _ZEROS[-n % ALIGN]


RESERVE_EVICT = 1
RESERVE_KEPT = 2       # GRANTED may name the evicted block a granted slot still holds


def encode_reserve(target: int, evict: bool = False, kept: bool = False) -> bytes:
    flags = (RESERVE_EVICT if evict else 0) | (RESERVE_KEPT if kept else 0)
    return record(RESERVE, _U32.pack(target) + _U32.pack(flags))


def encode_reset(token: int) -> bytes:
    return record(RESET, _U64.pack(token))


def encode_take_events(max_events: int) -> bytes:
    return record(TAKE_EVENTS, _U32.pack(max_events))


def encode_counters(lookups: int, hits: int, misses: int) -> bytes:
    return record(COUNTERS, _COUNTERS.pack(lookups, hits, misses))


def encode_release_held(session_id: str) -> bytes:
    return record(RELEASE_HELD, _str(session_id))


def encode_return_slots(offsets: Sequence[int]) -> bytes:
    return record(RETURN_SLOTS, _U32.pack(len(offsets)) + array("Q", offsets).tobytes())


def encode_promote(keys: Sequence[bytes]) -> bytes:
    return record(PROMOTE, _keys(keys))


def encode_find(step: int, keys: Sequence[bytes]) -> bytes:
    """Keys this engine's step `step` looked up that neither the index nor the held-below
    table names, in a namespace whose below table asks the store (FLAG_ASK): the daemon asks
    the cluster store about them and answers FOUND(step)."""
    return record(FIND, _U64.pack(step) + _keys(keys))


def encode_found(step: int) -> bytes:
    return record(FOUND, _U64.pack(step))


def encode_restore(keys: Sequence[bytes], offsets: Sequence[int]) -> bytes:
    """Granted slots (`offsets`) taken back as the evicted blocks (`keys`) GRANTED said they
    still hold."""
    if len(offsets) != len(keys):
        raise ValueError("one slot per restored key")
    return record(RESTORE, _keys(keys) + array("Q", offsets).tobytes())


def encode_hint(req_id: str, session: str, retain_ms: int) -> bytes:
    """Request `req_id`'s retention hint (docs/agents.md): the blocks it loads and stores are
    retained `retain_ms` (0: the daemon's retention.default_s), tagged with agent session
    `session` ("" for none). Sent before the request's other records."""
    return record(HINT, _str(req_id) + _str(session) + _U32.pack(retain_ms))


def encode_granted(offsets: Sequence[int], kept_index: Sequence[int] = (),
                   kept_keys: Sequence[bytes] = ()) -> bytes:
    """`kept_index[i]`: the position in `offsets` of a slot that still holds the evicted
    block `kept_keys[i]` (written only when there is one: a session that did not ask for
    them with RESERVE's flag 2 never gets the trailer)."""
    body = _U32.pack(len(offsets)) + array("Q", offsets).tobytes()
    if kept_index:
        body += _U32.pack(len(kept_index)) + array("I", kept_index).tobytes() \
            + _keys(kept_keys)
    return record(GRANTED, body)


def encode_reset_done(token: int, epoch: int, dropped: int) -> bytes:
    return record(RESET_DONE, _RESET_DONE.pack(token, epoch, dropped))


def encode_events(events: Sequence[tuple[Sequence[bytes], bool, bool]], more: bool,
                  dropped: int = 0) -> bytes:
    """`events`: (keys, removed, metadata_only) each; `dropped`: events of the namespace
    dropped unseen since the previous answer, written only when not 0 (a reader that predates
    the field skips only such an answer)."""
    parts = [_U32.pack(len(events))]
    for keys, removed, metadata_only in events:
        parts.append(_U8.pack(int(removed) | int(metadata_only) << 1))
        parts.append(_keys(keys))
    parts.append(_U8.pack(int(more)))
    if dropped:
        parts.append(_U64.pack(dropped))
    return record(EVENTS, b"".join(parts))


def events_bytes(keys: Sequence[bytes]) -> int:
    """What one event costs in an EVENTS record (at most)."""
    return 1 + _KEYS.size + sum(len(k) + 1 for k in keys)


def encode_rejected(kind: int, code: str, message: str) -> bytes:
    return record(REJECTED, _U16.pack(kind) + _str(code) + _str(message[:MAX_STRING_BYTES]))


# --- decoding ---------------------------------------------------------------------------------


class Cursor:
    """Reads fields off a payload, checking every length against what is left."""

    __slots__ = ("data", "at", "what")

    def __init__(self, data: bytes, what: str) -> None:
        self.data = data
        self.at = 0
        self.what = what

    def _take(self, n: int, field: str) -> int:
        at = self.at
        if n < 0 or at + n > len(self.data):
            raise RecordError(f"{self.what}: {field} runs past the end of the record")
        self.at = at + n
        return at

    def left(self) -> int:
        """Bytes not read yet."""
        return len(self.data) - self.at

    def u8(self, field: str) -> int:
        return self.data[self._take(1, field)]

    def u16(self, field: str) -> int:
        return _U16.unpack_from(self.data, self._take(2, field))[0]

    def u32(self, field: str) -> int:
        return _U32.unpack_from(self.data, self._take(4, field))[0]

    def u64(self, field: str) -> int:
        return _U64.unpack_from(self.data, self._take(8, field))[0]

    def text(self, field: str) -> str:
        n = self.u16(field)
        if n > MAX_STRING_BYTES:
            raise RecordError(f"{self.what}: {field} has {n} bytes, more than "
                              f"{MAX_STRING_BYTES}")
        at = self._take(n, field)
        try:
            return self.data[at:at + n].decode()
        except UnicodeDecodeError:
            raise RecordError(f"{self.what}: {field} is not UTF-8") from None

    def keys(self, field: str = "keys", *, unique: bool = True) -> list[bytes]:
        at = self._take(_KEYS.size, field)
        n, width, zero = _KEYS.unpack_from(self.data, at)
        if n > MAX_KEYS_PER_CALL:
            raise RecordError(f"{self.what}: {field} has {n} keys, more than "
                              f"MAX_KEYS_PER_CALL ({MAX_KEYS_PER_CALL})")
        if zero or width > MAX_KEY_BYTES:
            raise RecordError(f"{self.what}: {field} has a key width of {width} (keys are "
                              f"1..{MAX_KEY_BYTES} bytes)")
        data = self.data
        if width:
            at = self._take(n * width, field)
            keys = [data[at + i * width:at + (i + 1) * width] for i in range(n)]
        else:
            at = self._take(n, field)
            lengths = data[at:at + n]
            if n and (min(lengths) == 0 or max(lengths) > MAX_KEY_BYTES):
                raise RecordError(f"{self.what}: {field} holds an empty key or one over "
                                  f"{MAX_KEY_BYTES} bytes")
            at = self._take(sum(lengths), field)
            keys = []
            for length in lengths:
                keys.append(data[at:at + length])
                at += length
        if unique and len(set(keys)) != n:
            raise RecordError(f"{self.what}: {field} names a key twice (duplicate keys are not "
                              "allowed within one record)")
        return keys

    def values(self, code: str, n: int, field: str) -> list[int]:
        size = array(code).itemsize
        at = self._take(n * size, field)
        out = array(code)
        out.frombytes(self.data[at:at + n * size])
        return out.tolist()

    def positions(self, n: int) -> list[int] | None:
        if not self.u8("positions flag"):
            return None
        return self.values("q", n, "positions")

    def end(self) -> None:
        if self.at != len(self.data):
            raise RecordError(f"{self.what}: {len(self.data) - self.at} bytes left over after "
                              "its last field")


class Store(NamedTuple):
    req_id: str
    keys: list[bytes]
    positions: list[int] | None
    granted_keys: list[bytes]
    granted_offsets: list[int]


class CompleteStore(NamedTuple):
    keys: list[bytes]
    success: bool
    req_id: str
    epoch: int


class Pin(NamedTuple):
    keys: list[bytes]
    req_id: str
    positions: list[int] | None
    offsets: list[int]


class CompleteLoad(NamedTuple):
    keys: list[bytes]
    req_id: str
    epoch: int


class Touch(NamedTuple):
    keys: list[bytes]
    req_id: str


class RequestFinished(NamedTuple):
    req_id: str


class Reserve(NamedTuple):
    target: int
    evict: bool
    kept: bool = False


class Reset(NamedTuple):
    token: int


class TakeEvents(NamedTuple):
    max_events: int


class Counters(NamedTuple):
    lookups: int
    hits: int
    misses: int


class ReleaseHeld(NamedTuple):
    session_id: str


class ReturnSlots(NamedTuple):
    offsets: list[int]


class Promote(NamedTuple):
    keys: list[bytes]


class Restore(NamedTuple):
    keys: list[bytes]
    offsets: list[int]


class Find(NamedTuple):
    step: int
    keys: list[bytes]


class Hint(NamedTuple):
    req_id: str
    session: str
    retain_ms: int


UpRecord = (Store | CompleteStore | Pin | CompleteLoad | Touch | RequestFinished | Reserve | Reset
            | TakeEvents | Counters | ReleaseHeld | ReturnSlots | Promote | Restore | Hint
            | Find)


# The records a stepping engine sends every step, decoded compiled where built (a pass that
# checks the same rules and answers None for a record that breaks one: decoded below then,
# which says why).
_KEYED: dict[int, type] = {STORE: Store, COMPLETE_STORE: CompleteStore, PIN: Pin,
                           COMPLETE_LOAD: CompleteLoad}
_new_tuple = tuple.__new__


def decode_up(kind: int, payload: bytes) -> UpRecord:
    """An engine's record, checked against every bound (RecordError names what is wrong)."""
    if decode_keyed is not None and type(payload) is bytes:
        shape = _KEYED.get(kind)
        if shape is not None:
            fields = decode_keyed(kind, payload, MAX_STRING_BYTES, MAX_KEYS_PER_CALL,
                                  MAX_KEY_BYTES)
            if fields is not None:
                return _new_tuple(shape, fields)
    return decode_up_checked(kind, payload)


def decode_up_checked(kind: int, payload: bytes) -> UpRecord:
    """`decode_up` field by field in Python: every kind, and the reason a record is refused."""
    name = UP_KINDS.get(kind)
    if name is None:
        raise RecordError(f"unknown record kind {kind}")
    c = Cursor(payload, name)
    out: UpRecord
    if kind == STORE:
        req_id = c.text("req_id")
        keys = c.keys()
        positions = c.positions(len(keys))
        m = c.u32("granted count")
        if m > len(keys):
            raise RecordError(f"store: {m} granted slots for {len(keys)} offered keys")
        index = c.values("I", m, "granted key indices")
        offsets = c.values("Q", m, "granted offsets")
        if index and max(index) >= len(keys):
            raise RecordError("store: a granted key index is outside the offered keys")
        if len(set(index)) != m:
            raise RecordError("store: a granted key index is named twice")
        out = Store(req_id, keys, positions, [keys[i] for i in index], offsets)
    elif kind == COMPLETE_STORE:
        epoch = c.u64("epoch")
        success = c.u8("success")
        if success > 1:
            raise RecordError(f"complete_store: success is {success} (0 or 1)")
        req_id = c.text("req_id")
        out = CompleteStore(c.keys(), bool(success), req_id, epoch)
    elif kind == PIN:
        req_id = c.text("req_id")
        keys = c.keys()
        positions = c.positions(len(keys))
        out = Pin(keys, req_id, positions, c.values("Q", len(keys), "slot offsets"))
    elif kind == COMPLETE_LOAD:
        epoch = c.u64("epoch")
        req_id = c.text("req_id")
        out = CompleteLoad(c.keys(), req_id, epoch)
    elif kind == TOUCH:
        req_id = c.text("req_id")
        out = Touch(c.keys(), req_id)
    elif kind == REQUEST_FINISHED:
        out = RequestFinished(c.text("req_id"))
    elif kind == RESERVE:
        target = c.u32("target")
        if target > MAX_GRANTED_SLOTS:
            raise RecordError(f"reserve: target {target} is more than MAX_GRANTED_SLOTS "
                              f"({MAX_GRANTED_SLOTS})")
        flags = c.u32("flags")
        if flags & ~(RESERVE_EVICT | RESERVE_KEPT):
            raise RecordError(f"reserve: unknown flags {flags:#x}")
        out = Reserve(target, bool(flags & RESERVE_EVICT), bool(flags & RESERVE_KEPT))
    elif kind == RESET:
        out = Reset(c.u64("token"))
    elif kind == TAKE_EVENTS:
        n = c.u32("max_events")
        if n > MAX_EVENTS:
            raise RecordError(f"take_events: max_events {n} is more than {MAX_EVENTS}")
        out = TakeEvents(n)
    elif kind == COUNTERS:
        values = [c.u64(f) for f in ("lookups", "hits", "misses")]
        if max(values) > MAX_COUNTER_DELTA or values[1] + values[2] > values[0]:
            raise RecordError(f"counters: {values} are not lookups >= hits + misses (each "
                              f"at most {MAX_COUNTER_DELTA})")
        out = Counters(*values)
    elif kind == RELEASE_HELD:
        out = ReleaseHeld(c.text("session_id"))
    elif kind == PROMOTE:
        out = Promote(c.keys())
    elif kind == FIND:
        step = c.u64("step")
        out = Find(step, c.keys())
    elif kind == RESTORE:
        keys = c.keys()
        out = Restore(keys, c.values("Q", len(keys), "slot offsets"))
    elif kind == HINT:
        req_id = c.text("req_id")
        if not req_id:
            raise RecordError("hint: req_id is empty (a hint belongs to a request)")
        out = Hint(req_id, c.text("session"), c.u32("retain_ms"))
    else:  # RETURN_SLOTS
        n = c.u32("count")
        if n > MAX_GRANTED_SLOTS:
            raise RecordError(f"return_slots: {n} slots, more than MAX_GRANTED_SLOTS "
                              f"({MAX_GRANTED_SLOTS})")
        out = ReturnSlots(c.values("Q", n, "slot offsets"))
    c.end()
    return out


class Granted(NamedTuple):
    offsets: list[int]
    kept_index: Sequence[int] = ()      # offsets[kept_index[i]] still holds kept_keys[i]
    kept_keys: Sequence[bytes] = ()


class ResetDone(NamedTuple):
    token: int
    epoch: int
    dropped: int


class Events(NamedTuple):
    events: list[tuple[tuple[bytes, ...], bool, bool]]    # (keys, removed, metadata_only)
    more: bool
    dropped: int = 0      # events dropped unseen before these (nobody took them in time)


class Rejected(NamedTuple):
    kind: int
    code: str
    message: str


class Found(NamedTuple):
    step: int           # the FIND records of this step and before are answered


DownRecord = Granted | ResetDone | Events | Rejected | Found


def granted_fast(payload: bytes) -> Granted | None:
    """A GRANTED of the two shapes the daemon writes (offsets alone, or with its kept blocks'
    fixed-width keys) read in a few slices; None for any other (`decode_down` reads it, or
    says why). kvd_proto/native.py's `granted_apply` applies the same shapes to a reserve."""
    shape = granted_shape(payload)
    return None if shape is None else Granted(*shape)


def decode_down(kind: int, payload: bytes) -> DownRecord:
    """A daemon's answer (RecordError for one this version does not know)."""
    if kind == GRANTED:             # the common answer (a reserve's top-up), read at once
        fast = granted_fast(payload)
        if fast is not None and (not fast.offsets or max(fast.offsets) < 1 << 63):
            return fast                 # (else the checked decoder says what is wrong)
    name = DOWN_KINDS.get(kind)
    if name is None:
        raise RecordError(f"unknown answer kind {kind}")
    c = Cursor(payload, name)
    out: DownRecord
    if kind == GRANTED:
        offsets = c.values("Q", c.u32("count"), "offsets")
        if offsets and max(offsets) >= 1 << 63:    # no pool is that large (int64 offsets)
            raise RecordError("granted: an offset past 2^63")
        if c.left():
            m = c.u32("kept count")
            if m > len(offsets):
                raise RecordError(f"granted: {m} kept blocks for {len(offsets)} slots")
            index = c.values("I", m, "kept slot indices")
            keys = c.keys("kept keys", unique=False)      # the daemon's: checked there
            if len(keys) != m or (index and max(index) >= len(offsets)):
                raise RecordError("granted: the kept blocks do not match the slots")
            out = Granted(offsets, index, keys)
        else:
            out = Granted(offsets)
    elif kind == RESET_DONE:
        out = ResetDone(c.u64("token"), c.u64("epoch"), c.u64("dropped"))
    elif kind == EVENTS:
        events = []
        for _ in range(c.u32("count")):
            flags = c.u8("flags")
            events.append((tuple(c.keys(unique=False)), bool(flags & 1), bool(flags & 2)))
        more = bool(c.u8("more"))
        out = Events(events, more, c.u64("dropped") if c.at < len(c.data) else 0)
    elif kind == FOUND:
        out = Found(c.u64("step"))
    else:
        out = Rejected(c.u16("kind"), c.text("code"), c.text("message"))
    c.end()
    return out
