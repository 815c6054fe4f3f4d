"""The shared index's per-key loops: compiled (kvd_proto/_native.c) where it was built, else
their pure-Python twins here, with the same interface and results.

`pip install` builds the extension when a C compiler and Python's headers are there; without
them kvd installs and runs on the twins (slower per key, identical answers). `KVD_NATIVE=0`
in the environment forces the twins (the tests run both). `NATIVE` says which is in use.

- `Lookups`: the engine's lookups in a read-only mapping of an index: `lookup(key)` answers
  HIT (recording the slot's offset as a HIT of this step: `hit_offset(key)`, `hit(key,
  offset)` for one answered elsewhere, `clear_hits()` when the step ends) or MISS where the
  index alone decides, and calls
  `fallback(key)` otherwise (not `enabled`, a store in flight, the engine's own store, a key
  the namespace's "held below" table names: kvd_proto/below_layout.py, bound with
  `bind_below`); `find(key)`, `below(key)` and `find_new(keys, use_index)` probe without
  answering.
- The scheduler's steps, compiled only (kvd_proto/_steps.c: `store`, `pin`, `complete`,
  `settle`, methods of the compiled `Lookups`; `CompiledSteps` below, `steps_of` finds them):
  each does one call's common case on the engine's own containers, whose shapes are named
  here (`Store`, `StoreCall`, `SettleEntry`, `StepShared`: the C reads them by position). Their
  one Python twin is the session's own path (kvd_client/offload/transfers.py, stores.py,
  loads.py), which decides every case and, on the common one, answers and records exactly as
  the C does (tests/unit/test_steps_differential.py holds the two equal); `PyLookups` has no
  copy of them.
- `IndexTable`: the daemon's find / insert / set_ready / remove / key_of on its writable
  mapping.
- `keys_block`, `keys_record`: the channel's records that carry keys (a store, a pin, a
  completion: one per offload call of the scheduler, with up to hundreds of keys), encoded in
  one pass (kvd_proto/records.py has the layout).
- `KeptTable`, `list_discard`: the evicted blocks a session's granted slots still hold (a
  GRANTED applied in one pass: its slots into the reserve, its kept blocks into the table; an
  entry gone with its slot) and a slot taken back (kvd_client/offload/reserve.py keeps them).
"""
from __future__ import annotations

import importlib
import mmap
import os
import struct
from array import array
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Protocol, cast

from kvd_proto.below_layout import FLAG_ASK, FLAGS_OFFSET, BelowHeader, fingerprint
from kvd_proto.below_layout import MAX_PROBE as BELOW_MAX_PROBE
from kvd_proto.index_layout import (
    KEY_LEN_MASK,
    KEY_LEN_SHIFT,
    MAX_KEY_WIDTH,
    MAX_PROBE,
    STATE_FREE,
    STATE_MASK,
    STATE_READY,
    STATE_STORING,
    key_hash,
    meta_generation,
    meta_key_len,
    meta_state,
    meta_word,
    slot_offset,
)
from kvd_proto.wire import MAX_KEY_BYTES

Geometry = tuple[int, int, int, int, int, int, int, int, int]
"""buckets offset, buckets, meta offset, capacity, keys offset, key width, per extent, extent
bytes, stride (`Header.geometry`)."""


def probe(buckets: Any, meta: Any, data: Any, keys_offset: int, width: int, mask: int,
          key: bytes) -> tuple[int, int] | None:
    """(slot, meta word) of the slot holding `key` (storing or ready), or None: the lock-free
    read of docs/attach.md (bucket, meta word, key, meta word again)."""
    n = len(key)
    if not 0 < n <= width:
        return None
    b = key_hash(key) & mask
    for _ in range(MAX_PROBE):
        v = buckets[b]
        if not v:
            return None
        slot = v - 1
        if slot < len(meta):
            word = meta[slot]
            # The meta word's fields inline, not meta_state()/meta_key_len(): per bucket probed.
            if word & STATE_MASK and (word >> KEY_LEN_SHIFT) & KEY_LEN_MASK == n:
                start = keys_offset + slot * width
                if data[start:start + n] == key and meta[slot] == word:
                    return slot, word
        b = (b + 1) & mask
    return None


def probe_below(buckets: Any, mask: int, fp: int) -> int:
    """The bucket holding fingerprint `fp` in a "held below" table, or -1."""
    b = fp & mask
    for _ in range(BELOW_MAX_PROBE):
        v = buckets[b]
        if v == fp:
            return b
        if not v:
            return -1
        b = (b + 1) & mask
    return -1


def below_view(mapping: Any, writable: bool = False) -> tuple[Any, int]:
    """The buckets of the "held below" table in `mapping` (u64 view) and their mask."""
    header = BelowHeader.unpack(bytes(mapping[:64]))
    view = memoryview(mapping)
    if writable and view.readonly:
        view.release()
        raise TypeError("the daemon's below table mapping must be writable")
    if header.file_bytes > len(view):
        view.release()
        raise ValueError("below table runs past the end of the mapping")
    buckets = view[header.buckets_offset:header.file_bytes].cast("Q")
    view.release()
    return buckets, header.buckets - 1


def below_flags_view(mapping: Any, writable: bool = False) -> Any:
    """The flags word of the "held below" table in `mapping` (a one-item u32 view)."""
    view = memoryview(mapping)
    if writable and view.readonly:
        view.release()
        raise TypeError("the daemon's below table mapping must be writable")
    flags = view[FLAGS_OFFSET:FLAGS_OFFSET + 4].cast("I")
    view.release()
    return flags


class _Regions:
    """Views of an index's regions inside its mapping."""

    def __init__(self, mapping: Any, geometry: Geometry, writable: bool) -> None:
        (buckets_offset, buckets, meta_offset, capacity, keys_offset, width, per_extent,
         extent_bytes, stride) = geometry
        if (buckets < 1 or buckets & (buckets - 1) or not 0 < width <= MAX_KEY_WIDTH
                or not per_extent):
            raise ValueError("index geometry is not a valid layout")
        view = memoryview(mapping)
        if writable and view.readonly:
            view.release()
            raise TypeError("the daemon's index mapping must be writable")
        if max(buckets_offset + 4 * buckets, meta_offset + 8 * capacity,
               keys_offset + width * capacity) > len(view):
            view.release()
            raise ValueError("index regions run past the end of the mapping")
        self.data = mapping
        self.buckets = view[buckets_offset:buckets_offset + 4 * buckets].cast("I")
        self.meta = view[meta_offset:meta_offset + 8 * capacity].cast("Q")
        self.keys = view[keys_offset:keys_offset + width * capacity]
        view.release()
        self.keys_offset = keys_offset
        self.width = width
        self.mask = buckets - 1
        self.capacity = capacity
        self.per_extent, self.extent_bytes, self.stride = per_extent, extent_bytes, stride

    def find(self, key: bytes) -> tuple[int, int] | None:
        return probe(self.buckets, self.meta, self.data, self.keys_offset, self.width,
                     self.mask, key)

    def offset(self, slot: int) -> int:
        return slot_offset(slot, self.per_extent, self.extent_bytes, self.stride)

    def release(self) -> None:
        for view in (self.buckets, self.meta, self.keys):
            view.release()


# --- The engine's containers the compiled steps read and change --------------------------------
# kvd_client/offload/ keeps them (stores.py, loads.py) and kvd_proto/_steps.c reads them by
# position: they stay plain tuples (the C takes a store only when it is exactly a tuple, so a
# NamedTuple would send every call down the Python path). Named here, once, for both sides.

MAX_EPOCH = 2**63 - 1
"""The largest reset epoch the compiled steps read (a C long long): a store call of a larger
one makes no `StoreCall`, as the C's does not."""


class StepShared(Protocol):
    """What the stores made in one step under one reset epoch share (kvd_client/offload/
    stores.py `Shared`). The C reads the attributes by name: `reset_epoch` (< 0: a reset's
    answer still on its way) and `seq` (the step whose records told the daemon of them)."""

    reset_epoch: int
    seq: int


StoreCall = tuple[bytes, int]
"""One store call's (COMPLETE_STORE record of its whole success, its key count): made by the
store while the keys are at hand, sent by a completion of exactly those keys. The C reads [0]
and [1]."""

Store = tuple[int, StepShared] | tuple[int, StepShared, StoreCall]
"""A store of the engine in flight, a value of the stores dict (key -> Store): (slot offset, its
step's `StepShared`[, its call's `StoreCall`: only where the reset epoch was known]). The C
reads it by position and identity (`settle` forgets a key only while its store is that very
tuple)."""

SettleEntry = (tuple[int, tuple[bytes, ...], tuple[Store, ...]]
               | tuple[int, tuple[bytes, ...], tuple[Store, ...], bytes])
"""Completed stores to forget once the daemon has read step `seq`: (seq, keys, their stores[,
the keys' hashes as native Py_hash_t bytes, which the compiled `complete` keeps]); `settle`
reads it by position."""

StoreAnswer = tuple[list[bytes], list[int], bytes | None]
"""`store`'s answer: (the new keys, their slots' offsets, the STORE record; None when no key
is new)."""

PinAnswer = tuple[list[int], frozenset[bytes], bytes, bytes]
"""`pin`'s answer: (the keys' offsets, their set, the PIN record, the COMPLETE_LOAD record of
the whole pin); the session's LoadTracker keeps the set and that record per pin."""

CompleteAnswer = tuple[SettleEntry, bytes]
"""`complete`'s answer: (the entry to settle, the COMPLETE_STORE record)."""


class CompiledSteps(Protocol):
    """The scheduler's steps of the compiled `Lookups` (kvd_proto/_steps.c says what each does
    and when it answers None: the caller's Python path then decides)."""

    def store(self, keys: Sequence[bytes], positions: Sequence[int] | None, req_id: str,
              slots: list[int], shared: StepShared, per_record: int, room: int
              ) -> StoreAnswer | None: ...

    def pin(self, keys: Sequence[bytes], positions: Sequence[int] | None, req_id: str,
            per_record: int, epoch: int) -> PinAnswer | None: ...

    def complete(self, keys: Collection[bytes], completed: dict[bytes, None], req_id: str,
                 per_record: int) -> CompleteAnswer | None: ...

    def settle(self, entries: Sequence[SettleEntry], completed: dict[bytes, None]) -> None: ...


Mapped = mmap.mmap | memoryview
"""A mapped index or table file, as the lookups and the daemon's writes bind it."""


class IndexLookups(Protocol):
    """A session's lookups over its namespace's index: the compiled `_native.Lookups` or its
    twin `PyLookups` (the module doc says what each call does). `lookup` answers the `miss` or
    `hit` object it was made with, or whatever `fallback(key)` answers for the keys the index
    alone cannot decide."""

    enabled: int
    lookups: int
    hits: int
    misses: int

    @property
    def bound(self) -> bool: ...

    def bind(self, mapping: Mapped, /, *geometry: int) -> None: ...

    def unbind(self) -> None: ...

    def bind_below(self, mapping: Mapped, /) -> None: ...

    def below_flags(self) -> int: ...

    def unbind_below(self) -> None: ...

    def below(self, key: bytes, /) -> bool: ...

    def find(self, key: bytes, /) -> tuple[int, int] | None: ...

    def lookup(self, key: bytes, context: object = None, /) -> Any: ...

    def hit(self, key: bytes, offset: int, /) -> None: ...

    def hit_offset(self, key: bytes, /) -> int | None: ...

    def clear_hits(self) -> None: ...

    def recorded(self) -> dict[bytes, int]: ...

    def find_new(self, keys: Sequence[bytes], use_index: bool, /) -> list[bytes]: ...


class LookupsType(Protocol):
    """`Lookups(stores, miss, hit, fallback, kept=None)`: over the session's stores dict (key
    -> `Store`), answering `miss` / `hit`, and `fallback(key)` for the rest: a key the index
    does not hold that is one of `stores` or `kept` (the evicted blocks the session's granted
    slots still hold) or the held-below table names."""

    def __call__(self, stores: dict[bytes, Store], miss: Any, hit: Any,
                 fallback: Callable[[bytes], Any],
                 kept: KeptTableType | Collection[bytes] | None = None, /) -> IndexLookups: ...


class IndexWrites(Protocol):
    """The daemon's writes into a namespace's index: the compiled `_native.IndexTable` or its
    twin `PyIndexTable` (a slot's key, then its meta word, then its bucket; to free: meta,
    then bucket)."""

    overflows: int

    def find(self, key: bytes, /) -> int: ...

    def insert(self, slot: int, key: bytes, /) -> bool: ...

    def remove(self, slot: int, /) -> None: ...

    def key_of(self, slot: int, /) -> bytes: ...

    def set_ready(self, slot: int, /) -> None: ...

    def reachable(self, slots: bytes, /) -> bytes: ...

    def release(self) -> None: ...


class IndexTableType(Protocol):
    """`IndexTable(mapping, *geometry)`: over a writable mapping of the index file."""

    def __call__(self, mapping: Mapped, /, *geometry: int) -> IndexWrites: ...


KeysRecord = Callable[[int, bytes, "str | None", Sequence[bytes], bool, "Sequence[int] | None",
                       "Sequence[int] | None", "Sequence[int] | None"], bytes]
"""`keys_record(kind, prefix, req_id, keys, with_positions, positions, index, offsets)`: one
channel record of a kind that carries keys (records.py's encoders)."""

RingWrite = Callable[[memoryview, int, int, int, Sequence[bytes]], "tuple[int, int] | None"]
"""`ring_write(data, tail, free, max_record, records)`: (records written, the new tail), or
None where the ring has no room (kvd_proto/channel.py's RingWriter)."""

RingRead = Callable[[memoryview, int, int, int, bool, int],
                    "tuple[list[tuple[int, bytes]], int, str | None]"]
"""`ring_read(data, head, tail, max_record, strict, limit)`: ([(kind, payload)], the new head,
the error that stopped the read or None) (kvd_proto/channel.py's RingReader)."""

DecodeKeyed = Callable[[int, bytes, int, int, int], "tuple[Any, ...] | None"]
"""`decode_keyed(kind, payload, max_string, max_keys, max_key)`: the fields of a STORE, PIN or
completion record in its NamedTuple's order, or None for anything the strict decoder would
refuse (kvd_proto/records.py then decodes it in Python and says why)."""

KeyPositions = Callable[[Callable[[bytes], "int | None"] | dict[bytes, int], Sequence[bytes]],
                        "Sequence[int] | None"]
"""`key_positions(position, keys)`: the keys' token positions, a range for consecutive chunks,
None where one is unknown."""


def steps_of(lookups: object) -> CompiledSteps | None:
    """`lookups` where it carries the compiled steps, None for the twin (`PyLookups` has no
    copy of them: the session's Python path is their one Python implementation)."""
    return None if isinstance(lookups, PyLookups) else lookups  # type: ignore[return-value]


class PyLookups:
    """The Python twin of `_native.Lookups` (see the module doc), less the scheduler's steps
    (`store`, `pin`, `complete`, `settle`): their twin is the session's own Python path."""

    def __init__(self, stores: dict[bytes, Store], miss: Any, hit: Any,
                 fallback: Callable[[bytes], Any],
                 kept: KeptTableType | Collection[bytes] | None = None) -> None:
        self._hits: dict[bytes, int] = {}          # this step's HITs -> offset
        self._stores = stores
        self._kept: KeptTableType | Collection[bytes] = kept if kept is not None else ()
        self._miss = miss
        self._hit = hit
        self._fallback = fallback
        self._regions: _Regions | None = None
        self._below: Any = None
        self._below_mask = 0
        self._below_flags: Any = None
        self.enabled = 0
        self.lookups = self.hits = self.misses = 0

    @property
    def bound(self) -> bool:
        return self._regions is not None

    def bind(self, mapping: Any, *geometry: int) -> None:
        self.unbind()
        self._regions = _Regions(mapping, geometry, writable=False)  # type: ignore[arg-type]

    def unbind(self) -> None:
        self.enabled = 0
        if self._regions is not None:
            self._regions.release()
            self._regions = None
        self.unbind_below()

    def bind_below(self, mapping: Any) -> None:
        self.unbind_below()
        self._below, self._below_mask = below_view(mapping)
        self._below_flags = below_flags_view(mapping)

    def unbind_below(self) -> None:
        if self._below is not None:
            self._below.release()
            self._below_flags.release()
            self._below = self._below_flags = None

    def below_flags(self) -> int:
        return 0 if self._below_flags is None else self._below_flags[0]

    def below(self, key: bytes) -> bool:
        if type(key) is not bytes:
            raise TypeError("key must be bytes")
        return self._below is not None and \
            probe_below(self._below, self._below_mask, fingerprint(key)) >= 0

    def find(self, key: bytes) -> tuple[int, int] | None:
        regions = self._regions
        if regions is None:
            return None
        found = regions.find(key)
        return None if found is None else (meta_state(found[1]), regions.offset(found[0]))

    def lookup(self, key: bytes, _context: object = None) -> Any:
        regions = self._regions
        if not self.enabled or regions is None or type(key) is not bytes:
            return self._fallback(key)
        found = regions.find(key)
        if found is not None:
            if found[1] & STATE_MASK != STATE_READY:      # inline, not meta_state(): per key
                return self._fallback(key)
            self._hits[key] = regions.offset(found[0])
            self.lookups += 1
            self.hits += 1
            return self._hit
        if key in self._stores or key in self._kept or (self._below is not None and (
                self._below_flags[0] & FLAG_ASK or
                probe_below(self._below, self._below_mask, fingerprint(key)) >= 0)):
            return self._fallback(key)
        self.lookups += 1
        self.misses += 1
        return self._miss

    def hit(self, key: bytes, offset: int) -> None:
        if not isinstance(key, bytes):
            raise TypeError("hit(key: bytes, offset: int)")
        self._hits[key] = offset

    def hit_offset(self, key: bytes) -> int | None:
        return self._hits.get(key)

    def clear_hits(self) -> None:
        self._hits.clear()

    def recorded(self) -> dict[bytes, int]:
        return dict(self._hits)

    def find_new(self, keys: Sequence[bytes], use_index: bool) -> list[bytes]:
        stores, regions = self._stores, self._regions
        find = regions.find if use_index and regions is not None else None
        return [k for k in keys if k not in stores and (find is None or find(k) is None)]


class PyIndexTable:
    """The Python twin of `_native.IndexTable`: the daemon's writes, in the index's order
    (a slot's key, then its meta word, then its bucket; to free: meta, then bucket)."""

    def __init__(self, mapping: Any, *geometry: int) -> None:
        self._r = _Regions(mapping, geometry, writable=True)  # type: ignore[arg-type]
        self.overflows = 0

    def find(self, key: bytes) -> int:
        found = self._r.find(key)
        return -1 if found is None else found[0]

    def insert(self, slot: int, key: bytes) -> bool:
        r = self._r
        if not 0 <= slot < r.capacity:
            raise IndexError(f"slot {slot} outside the index ({r.capacity} slots)")
        if not 0 < len(key) <= r.width:
            return False
        home = key_hash(key) & r.mask
        buckets = r.buckets
        for probe_ in range(MAX_PROBE):
            b = (home + probe_) & r.mask
            if buckets[b] == 0:
                r.keys[slot * r.width:slot * r.width + len(key)] = key
                r.meta[slot] = meta_word(STATE_STORING, len(key),
                                         meta_generation(r.meta[slot]) + 1)
                buckets[b] = slot + 1
                return True
        self.overflows += 1
        return False

    def reachable(self, slots: bytes) -> bytes:
        ids = memoryview(slots).cast("q")
        r = self._r
        out = bytearray(len(ids))
        for i, slot in enumerate(ids):
            if 0 <= slot < r.capacity and meta_state(r.meta[slot]) != STATE_FREE:
                key = self.key_of(slot)
                out[i] = bool(key) and self.find(key) == slot
        return bytes(out)

    def _home(self, slot: int, key_len: int) -> int:
        r = self._r
        off = slot * r.width
        return key_hash(r.keys[off:off + key_len]) & r.mask

    def remove(self, slot: int) -> None:
        r = self._r
        if not 0 <= slot < r.capacity:
            raise IndexError(f"slot {slot} outside the index ({r.capacity} slots)")
        word = r.meta[slot]
        if meta_state(word) == STATE_FREE:
            return
        home = self._home(slot, meta_key_len(word))
        r.meta[slot] = meta_word(STATE_FREE, 0, meta_generation(word) + 1)
        buckets = r.buckets
        for probe_ in range(MAX_PROBE):
            b = (home + probe_) & r.mask
            v = buckets[b]
            if v == 0:
                return
            if v == slot + 1:
                self._delete_bucket(b)
                return

    def _delete_bucket(self, hole: int) -> None:
        """Backward-shift deletion: later entries of the run move up, no tombstones."""
        r = self._r
        buckets, mask, meta = r.buckets, r.mask, r.meta
        j = hole
        for _ in range(mask + 1):
            j = (j + 1) & mask
            v = buckets[j]
            if v == 0:
                break
            home = self._home(v - 1, meta_key_len(meta[v - 1]))
            # The entry at j may fill the hole unless its home lies cyclically in (hole, j].
            if (hole < j and hole < home <= j) or (hole > j and (home > hole or home <= j)):
                continue
            buckets[hole] = v
            hole = j
        buckets[hole] = 0

    def set_ready(self, slot: int) -> None:
        r = self._r
        if not 0 <= slot < r.capacity:
            raise IndexError(f"slot {slot} outside the index ({r.capacity} slots)")
        word = r.meta[slot]
        if meta_state(word) == STATE_STORING:
            r.meta[slot] = word & ~STATE_MASK | STATE_READY

    def key_of(self, slot: int) -> bytes:
        r = self._r
        if not 0 <= slot < r.capacity:
            raise IndexError(f"slot {slot} outside the index ({r.capacity} slots)")
        word = r.meta[slot]
        if meta_state(word) == STATE_FREE:
            return b""
        off = slot * r.width
        return bytes(r.keys[off:off + meta_key_len(word)])

    def release(self) -> None:
        self._r.release()


def py_keys_block(keys: Sequence[bytes]) -> bytes:
    """The Python twin of `_native.keys_block`: a record's keys field (kvd_proto/records)."""
    n = len(keys)
    if not n:
        return struct.pack("<IHH", 0, 0, 0)
    width = len(keys[0])
    joined = b"".join(keys)
    if width and len(joined) == n * width and max(map(len, keys)) == width:
        return struct.pack("<IHH", n, width, 0) + joined
    return struct.pack("<IHH", n, 0, 0) + bytes(map(len, keys)) + joined


def py_keys_record(kind: int, prefix: bytes, req_id: str | None, keys: Sequence[bytes],
                   with_positions: bool, positions: Sequence[int] | None,
                   index: Sequence[int] | None, offsets: Sequence[int] | None) -> bytes:
    """The Python twin of `_native.keys_record`: one channel record of the kinds that carry
    keys (kvd_proto/records.py): `prefix` as given, the request (None: no such field), the keys
    field, with_positions: the optional positions column (one per key, or none), `index`
    (None: no field) as a u32 count and u32s, `offsets` (None: no field) as u64s."""
    parts = [prefix]
    if req_id is not None:
        data = req_id.encode()
        parts.append(struct.pack("<H", len(data)) + data)
    parts.append(py_keys_block(keys))
    if with_positions:
        if positions:
            if len(positions) != len(keys):
                raise ValueError("one position per key")
            parts.append(struct.pack(f"<B{len(positions)}q", 1, *positions))
        else:
            parts.append(b"\0")
    if index is not None:
        parts.append(struct.pack("<I", len(index)) + array("I", index).tobytes())
    if offsets is not None:
        parts.append(array("Q", offsets).tobytes())
    payload = b"".join(parts)
    n = 8 + len(payload)
    return struct.pack("<IHH", n, kind, 0) + payload + bytes(-n % 8)


def py_key_positions(position: Callable[[bytes], int | None] | dict[bytes, int],
                     keys: Sequence[bytes]) -> Sequence[int] | None:
    """The Python twin of `_native.key_positions`: the keys' token positions (`position(key)`,
    vLLM's ReqContext.get_offload_key_position, or the dict it reads), for the daemon's
    eviction order. The keys of one call are almost always consecutive chunks: then three
    reads (first, middle, last) give them all, as a range; otherwise every key is read. None
    when a key has none."""
    # A dict is read directly (exactly a dict, as the compiled one reads it); else called.
    get = position.get if type(position) is dict else \
        cast(Callable[[bytes], int | None], position)
    n = len(keys)
    if n >= 3:
        first, middle, last = get(keys[0]), get(keys[n // 2]), get(keys[-1])
        if first is not None and last is not None and middle is not None:
            step, rest = divmod(last - first, n - 1)
            if step > 0 and not rest and middle == first + step * (n // 2):
                return range(first, last + 1, step)
    positions = list(map(get, keys))
    return None if None in positions else positions  # type: ignore[return-value]


def py_same_set(a: object, b: object) -> bool:
    """The Python twin of `_native.same_set`: True only for the same object (the compiled one
    also finds two sets whose tables hold the same objects; False says nothing either way)."""
    return a is b


def py_eventfd_signal(fd: int) -> bool:
    """The Python twin of `_native.eventfd_signal` (this one releases the GIL around the
    write: another thread of the engine may run first)."""
    try:
        os.eventfd_write(fd, 1)
    except BlockingIOError:
        return False
    return True


_U32 = struct.Struct("<I")
_KEYS = struct.Struct("<IHH")        # a keys field's head: count, width, 0 (fixed width)


def granted_shape(payload: bytes
                  ) -> tuple[list[int], Sequence[int], Sequence[bytes]] | None:
    """A GRANTED payload of the two shapes the daemon writes (docs/attach.md): (offsets, kept
    blocks' indices into them, their keys), read in a few slices; None for any other shape
    (kvd_proto/records.py's checked decoder reads it, or says why)."""
    size = len(payload)
    if size < 4:
        return None
    count = _U32.unpack_from(payload)[0]
    at = 4 + 8 * count
    view = memoryview(payload)
    if size == at:                                  # offsets alone
        return view[4:].cast("Q").tolist(), (), ()
    if at + 4 + _KEYS.size > size:
        return None
    m = _U32.unpack_from(payload, at)[0]
    keys_at = at + 4 + 4 * m
    if m > count or keys_at + _KEYS.size > size:
        return None
    n, width, zero = _KEYS.unpack_from(payload, keys_at)
    start = keys_at + _KEYS.size
    if n != m or zero or not 0 < width <= MAX_KEY_BYTES or start + n * width != size:
        return None
    index = view[at + 4:keys_at].cast("I").tolist()
    if index and max(index) >= count:
        return None
    keys = [payload[i:i + width] for i in range(start, size, width)]
    return view[4:at].cast("Q").tolist(), index, keys


INT64_LIMIT = 2 ** 63           # a KeptTable's values are signed 64-bit


class PyKeptTable:
    """The Python twin of `_native.KeptTable` (kvd_proto/_grants.c): the evicted blocks a
    session's granted slots still hold, key -> the offset of the slot (>= 0, the very object
    granted), or -(seq + 1) while the session takes it back. An offset is in at most one
    entry: putting it replaces the entry that held it."""

    __slots__ = ("_values", "_at")

    def __init__(self) -> None:
        self._values: dict[bytes, int] = {}
        self._at: dict[int, bytes] = {}           # offset -> key, entries with an offset

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and bytes(key) in self._values

    @staticmethod
    def _key(key: object) -> bytes:
        if not isinstance(key, bytes):
            raise TypeError("a kept block's key must be bytes")
        return bytes(key)

    def get(self, key: bytes) -> int | None:
        return self._values.get(self._key(key))

    def pop(self, key: bytes) -> int | None:
        value = self._values.pop(self._key(key), None)
        if value is not None and value >= 0:
            del self._at[value]
        return value

    def put(self, key: bytes, value: int) -> None:
        key = self._key(key)
        if not isinstance(value, int):
            raise TypeError("a kept block's value must be an int")
        if not -INT64_LIMIT <= value < INT64_LIMIT:
            raise OverflowError("a kept block's value does not fit 64 bits")
        if len(key) > MAX_KEY_BYTES:
            raise ValueError("a kept block's key is longer than 128 bytes")
        self.pop(key)
        if value >= 0:
            held = self._at.pop(value, None)
            if held is not None:
                del self._values[held]
            self._at[value] = key
        self._values[key] = value

    def discard_offsets(self, offsets: Iterable[int]) -> None:
        if not self._values:
            return
        for offset in offsets:
            if not self._values:
                break
            if not isinstance(offset, int):
                raise TypeError("a kept block's value must be an int")
            key = self._at.pop(offset, None) if offset >= 0 else None
            if key is not None:
                del self._values[key]

    def items(self) -> list[tuple[bytes, int]]:
        return list(self._values.items())

    def clear(self) -> None:
        self._values.clear()
        self._at.clear()

    def apply(self, payload: bytes, slots: list[int]) -> int | None:
        """A GRANTED of the shapes the daemon writes: its offsets in at the front of `slots`,
        each kept block put (key, offset); the slots granted, or None (nothing changed) for
        any other shape, which the checked decoder reads."""
        granted = granted_shape(payload)
        if granted is None:
            return None
        offsets, index, keys = granted
        if offsets and max(offsets) >= INT64_LIMIT:
            return None
        slots[:0] = offsets
        for i, key in zip(index, keys, strict=True):
            self.put(key, offsets[i])
        return len(offsets)


class KeptTableType(Protocol):
    """`_native.KeptTable` and `PyKeptTable`, as the reserve and the lookups use them."""

    def __len__(self) -> int: ...

    def __contains__(self, key: object, /) -> bool: ...

    def get(self, key: bytes, /) -> int | None: ...

    def pop(self, key: bytes, /) -> int | None: ...

    def put(self, key: bytes, value: int, /) -> None: ...

    def discard_offsets(self, offsets: Iterable[int], /) -> None: ...

    def items(self) -> list[tuple[bytes, int]]: ...

    def clear(self) -> None: ...

    def apply(self, payload: bytes, slots: list[int], /) -> int | None: ...


def py_list_discard(items: list[Any], obj: object) -> bool:
    """The Python twin of `_native.list_discard`: `obj` removed from `items` (False: absent).
    The compiled one finds the very object first: the same list after, wherever no two
    elements are equal (a reserve's slots never are)."""
    try:
        items.remove(obj)
    except ValueError:
        return False
    return True


def compiled(module: str) -> Any:
    """The compiled extension `module` (e.g. "kvd_proto._native"), or None where it was not
    built or `KVD_NATIVE=0` forces the pure-Python twins (kvd_server/tiers/disk/block_io.py asks
    for its own extension the same way)."""
    if os.environ.get("KVD_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


_native = compiled("kvd_proto._native")
NATIVE = _native is not None
Lookups: LookupsType = _native.Lookups if _native is not None else PyLookups
IndexTable: IndexTableType = _native.IndexTable if _native is not None else PyIndexTable
crc32: Callable[[bytes], int] = _native.crc32 if _native is not None else key_hash
key_fingerprint: Callable[[bytes], int] = \
    _native.fingerprint if _native is not None else fingerprint
keys_block: Callable[[Sequence[bytes]], bytes] = \
    _native.keys_block if _native is not None else py_keys_block
keys_record: KeysRecord = \
    _native.keys_record if _native is not None else py_keys_record
# A ring's appends and reads in one pass (kvd_proto/_rings.c); None: kvd_proto/channel.py's
# Python loops (its RingWriter._write_runs and RingReader.read are the twins).
ring_write: RingWrite | None = \
    _native.ring_write if _native is not None else None
ring_read: RingRead | None = \
    _native.ring_read if _native is not None else None
# The daemon's strict decoding of the keyed up records in one pass (kvd_proto/_decode.c);
# None: kvd_proto/records.py's decode_up (the twin, and what says why a record is refused).
decode_keyed: DecodeKeyed | None = \
    _native.decode_keyed if _native is not None else None
# A reserve's top-up and its kept blocks, no Python object per key (kvd_proto/_grants.c); the
# twins above otherwise.
KeptTable: Callable[[], KeptTableType] = \
    _native.KeptTable if _native is not None else PyKeptTable
list_discard: Callable[[list[Any], object], bool] = \
    _native.list_discard if _native is not None else py_list_discard
key_positions: KeyPositions = \
    _native.key_positions if _native is not None else py_key_positions
same_set: Callable[[object, object], bool] = \
    _native.same_set if _native is not None else py_same_set
eventfd_signal: Callable[[int], bool] = \
    _native.eventfd_signal if _native is not None else py_eventfd_signal
STATES = (STATE_FREE, STATE_STORING, STATE_READY)
