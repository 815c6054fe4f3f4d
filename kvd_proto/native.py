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
- `IndexTable`: the daemon's find / insert / set_ready / remove / key_of on its writable
  mapping.
- `keys_block`, `keys_record`: the channel's records that carry keys (a store, a pin, a
  completion: one per offload call of the scheduler, with up to hundreds of keys), encoded in
  one pass (kvd_proto/records.py has the layout).
"""

from __future__ import annotations

import importlib
import os
import struct
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from kvd_proto.below_layout import MAX_PROBE as BELOW_MAX_PROBE
from kvd_proto.below_layout import BelowHeader, fingerprint
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


_MAX_EPOCH = 2**63 - 1  # a reset epoch the compiled path reads (a C long long)
STORE_KIND = 1         # kvd_proto/records.py STORE (records imports this module)
COMPLETE_STORE_KIND = 2  # kvd_proto/records.py COMPLETE_STORE
PIN_KIND = 3           # kvd_proto/records.py PIN
COMPLETE_LOAD_KIND = 4  # kvd_proto/records.py COMPLETE_LOAD


def _positions_for(positions: Sequence[int] | None, n: int) -> Sequence[int] | None:
    """`positions` when it has one entry per key, else None (the record then carries none)."""
    return positions if positions is not None and n and len(positions) == n else None


class PyLookups:
    """The Python twin of `_native.Lookups` (see the module doc)."""

    def __init__(self, stores: dict[bytes, Any], miss: Any, hit: Any,
                 fallback: Callable[[bytes], Any]) -> None:
        self._hits: dict[bytes, int] = {}          # this step's HITs -> offset
        self._stores = stores
        self._miss = miss
        self._hit = hit
        self._fallback = fallback
        self._regions: _Regions | None = None
        self._below: Any = None
        self._below_mask = 0
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

    def unbind_below(self) -> None:
        if self._below is not None:
            self._below.release()
            self._below = None

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
        if key in self._stores or (self._below is not None and probe_below(
                self._below, self._below_mask, fingerprint(key)) >= 0):
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

    def _offsets_of(self, keys: Sequence[bytes]) -> list[int] | None:
        offsets = list(map(self._hits.get, keys))
        return None if None in offsets else offsets  # type: ignore[return-value]

    def find_new(self, keys: Sequence[bytes], use_index: bool) -> list[bytes]:
        stores, regions = self._stores, self._regions
        find = regions.find if use_index and regions is not None else None
        return [k for k in keys if k not in stores and (find is None or find(k) is None)]

    def store(self, keys: Sequence[bytes], positions: Sequence[int] | None, req_id: str,
              slots: list[int], shared: Any, per_record: int, room: int
              ) -> tuple[list[bytes], list[int], bytes | None] | None:
        """A store call's common case (kvd_proto/_steps.c says what it does and when it
        answers None instead)."""
        if type(slots) is not list:
            raise TypeError("slots must be a list")
        n = len(keys)
        regions = self._regions
        if not self.enabled or regions is None or not 0 < n <= per_record or \
                any(type(k) is not bytes for k in keys) or len(set(keys)) != n:
            return None
        stores = self._stores
        index = [i for i, k in enumerate(keys) if k not in stores and regions.find(k) is None]
        m = len(index)
        if m > room or m > len(slots):
            return None
        new = [keys[i] for i in index]
        taken = slots[len(slots) - m:]
        if not m:
            return new, taken, None
        record = keys_record(STORE_KIND, b"", req_id, keys, True,
                             _positions_for(positions, n), index, taken)
        epoch = getattr(shared, "reset_epoch", -1)
        if isinstance(epoch, int) and 0 <= epoch <= _MAX_EPOCH:
            call = (keys_record(COMPLETE_STORE_KIND, struct.pack("<QB", epoch, True), req_id,
                                new, False, None, None, None), m)
            stores.update(zip(new, ((offset, shared, call) for offset in taken), strict=True))
        else:
            stores.update(zip(new, ((offset, shared) for offset in taken), strict=True))
        del slots[len(slots) - m:]
        return new, taken, record

    def pin(self, keys: Sequence[bytes], positions: Sequence[int] | None, req_id: str,
            per_record: int, epoch: int
            ) -> tuple[list[int], frozenset[bytes], bytes, bytes] | None:
        """A load call's common case, with the completion its whole pin will send
        (kvd_proto/_steps.c)."""
        n = len(keys)
        if not 0 < n <= per_record:
            return None
        offsets = self._offsets_of(keys)
        if offsets is None:
            return None
        keyset = frozenset(keys)
        if len(keyset) != n:
            return None
        record = keys_record(PIN_KIND, b"", req_id, keys, True, _positions_for(positions, n),
                             None, offsets)
        done = keys_record(COMPLETE_LOAD_KIND, struct.pack("<Q", epoch), req_id, keys, False,
                           None, None, None)
        return offsets, keyset, record, done

    def complete(self, keys: Sequence[bytes], completed: dict[bytes, None], req_id: str,
                 per_record: int) -> tuple[tuple[Any, tuple[bytes, ...], tuple[Any, ...], bytes],
                                           bytes] | None:
        """A successful completion's common case (kvd_proto/_steps.c)."""
        if not isinstance(completed, dict):
            raise TypeError("completed must be a dict")
        keys = tuple(keys)
        n = len(keys)
        if not 0 < n <= per_record:
            return None
        stores = self._stores
        got = tuple(stores.get(k) for k in keys)
        if any(type(g) is not tuple or len(g) < 2 for g in got):
            return None
        shared = got[0][1]
        if any(g[1] is not shared for g in got) or len(set(keys)) != n:
            return None
        epoch, seq = shared.reset_epoch, shared.seq
        if epoch < 0:
            return None
        calls = {id(g[2]) if len(g) > 2 else None for g in got}
        call = got[0][2] if len(got[0]) > 2 and len(calls) == 1 else None
        if call is not None and call[1] == n:
            record = call[0]
        else:
            record = keys_record(COMPLETE_STORE_KIND, struct.pack("<QB", epoch, True), req_id,
                                 keys, False, None, None, None)
        completed.update(dict.fromkeys(keys))
        hashes = array("q", map(hash, keys)).tobytes()
        return (seq, keys, got, hashes), record

    def settle(self, entries: Sequence[tuple[Any, ...]], completed: dict[bytes, None]) -> None:
        """Forget the completed stores the daemon has read (kvd_proto/_steps.c)."""
        if not isinstance(completed, dict):
            raise TypeError("settle(entries, completed: dict)")
        stores = self._stores
        for entry in entries:
            if len(entry) not in (3, 4) or len(entry[1]) != len(entry[2]):
                raise TypeError("an entry is (seq, keys, stores[, hashes]), one store per key")
            for key, store in zip(entry[1], entry[2], strict=True):
                if stores.get(key) is store:
                    del stores[key]
                    completed.pop(key, None)


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
    if type(position) is dict:
        position = position.get
    n = len(keys)
    if n >= 3:
        first, middle, last = position(keys[0]), position(keys[n // 2]), position(keys[-1])
        if first is not None and last is not None and middle is not None:
            step, rest = divmod(last - first, n - 1)
            if step > 0 and not rest and middle == first + step * (n // 2):
                return range(first, last + 1, step)
    positions = list(map(position, keys))
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
Lookups: Any = _native.Lookups if _native is not None else PyLookups
IndexTable: Any = _native.IndexTable if _native is not None else PyIndexTable
crc32: Callable[[bytes], int] = _native.crc32 if _native is not None else key_hash
key_fingerprint: Callable[[bytes], int] = \
    _native.fingerprint if _native is not None else fingerprint
keys_block: Callable[[Sequence[bytes]], bytes] = \
    _native.keys_block if _native is not None else py_keys_block
keys_record: Callable[..., bytes] = \
    _native.keys_record if _native is not None else py_keys_record
# A ring's appends and reads in one pass (kvd_proto/_rings.c); None: kvd_proto/channel.py's
# Python loops (its RingWriter._write_runs and RingReader.read are the twins).
ring_write: Callable[..., tuple[int, int] | None] | None = \
    _native.ring_write if _native is not None else None
ring_read: Callable[..., tuple[list[tuple[int, bytes]], int, str | None]] | None = \
    _native.ring_read if _native is not None else None
# The daemon's strict decoding of the keyed up records in one pass (kvd_proto/_decode.c);
# None: kvd_proto/records.py's decode_up (the twin, and what says why a record is refused).
decode_keyed: Callable[..., tuple | None] | None = \
    _native.decode_keyed if _native is not None else None
key_positions: Callable[..., Sequence[int] | None] = \
    _native.key_positions if _native is not None else py_key_positions
same_set: Callable[[object, object], bool] = \
    _native.same_set if _native is not None else py_same_set
eventfd_signal: Callable[[int], bool] = \
    _native.eventfd_signal if _native is not None else py_eventfd_signal
STATES = (STATE_FREE, STATE_STORING, STATE_READY)
