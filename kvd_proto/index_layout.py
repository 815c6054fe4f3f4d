"""The shared index's byte layout (version 1): what the daemon writes and clients read.

Each namespace's index is one memory file, sized once when the namespace is created, that the
daemon writes and every attached engine of the namespace maps read-only (sealed against
writes, shrinking and growing). All integers are little-endian. Regions, in order:

  header   HEADER_BYTES   the fields of `Header` (offsets below), then zeros
  buckets  u32[buckets]   open addressing, linear probing: slot id + 1, or 0 for empty
  meta     u64[capacity]  per slot: state (bits 0-1), key length (bits 2-9), generation (10-63)
  keys     capacity x key_width bytes: the slot's key, its first `key length` bytes

A key's first bucket is `crc32(key) % buckets` (zlib's CRC-32, init 0); probe forward at most
MAX_PROBE buckets. A slot id names a pool offset: `(slot // per_extent) * extent_bytes +
(slot % per_extent) * stride`.

Reading (lock-free): probe; for a bucket holding slot s, read meta[s], compare the key bytes,
read meta[s] again: equal words and equal keys mean the answer is consistent. READY is a HIT
(readable), STORING a pending store (not readable yet), anything else a miss.

Writing order (the daemon): a slot's key, then its meta, then the bucket that points at it; to
free: meta first (FREE, generation + 1), then the bucket. Freed slots are reused only after
every reader has published an epoch at or past the `reclaim_epoch` the daemon set after the
free (see `MARKS_LAYOUT`), so a reader that saw a block READY can copy out of its slot for as
long as it keeps its published epoch.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

VERSION = 1
MAGIC = b"KVDIDX01"
HEADER_BYTES = 4096
MAX_PROBE = 64

STATE_FREE = 0
STATE_STORING = 1
STATE_READY = 2

# A slot's meta word: state (bits 0-1), key length (bits 2-9), generation (bits 10-63). The
# loops in kvd_proto/native.py use these; kvd_proto/_native.c keeps inline copies, which
# tests/unit/test_index_geometry_one_source.py holds equal to these.
STATE_MASK = 0x3
KEY_LEN_SHIFT = 2
KEY_LEN_MASK = 0xFF
GENERATION_SHIFT = 10
MAX_KEY_WIDTH = KEY_LEN_MASK    # the longest key a meta word can state the length of

# magic, version, header bytes, capacity, buckets, key width, per extent, stride, extent
# bytes, reset epoch, reclaim epoch
_HEADER = struct.Struct("<8sIIIIIIQQQQ")
RESET_EPOCH_OFFSET = 48     # u64, the namespace's epoch (+1 per reset)
RECLAIM_EPOCH_OFFSET = 56   # u64, raised by the daemon after freeing slots

# A session's marks file (read/write for the session, read by the daemon): u64 at offset 0,
# the oldest reclaim epoch the session may still act on; 0 means none published yet. The
# reclaim epoch starts at FIRST_RECLAIM_EPOCH, so every epoch a reader publishes is nonzero.
FIRST_RECLAIM_EPOCH = 1
MARKS_BYTES = 4096
MARKS_LAYOUT = "u64 published_epoch at offset 0 (little-endian); the rest reserved, zero"


key_hash = zlib.crc32          # a key's hash: zlib's CRC-32, init 0 (the C function itself)


def meta_word(state: int, key_len: int, generation: int) -> int:
    return state | (key_len << KEY_LEN_SHIFT) | (generation << GENERATION_SHIFT)


def meta_state(word: int) -> int:
    return word & STATE_MASK


def meta_key_len(word: int) -> int:
    return (word >> KEY_LEN_SHIFT) & KEY_LEN_MASK


def meta_generation(word: int) -> int:
    return word >> GENERATION_SHIFT


def slot_offset(slot: int, per_extent: int, extent_bytes: int, stride: int) -> int:
    """The pool offset of a slot id: its extent's start, then its place in the extent."""
    return slot // per_extent * extent_bytes + slot % per_extent * stride


@dataclass(frozen=True, slots=True)
class Header:
    capacity: int
    buckets: int
    key_width: int
    per_extent: int
    stride: int
    extent_bytes: int

    @property
    def buckets_offset(self) -> int:
        return HEADER_BYTES

    @property
    def meta_offset(self) -> int:
        return HEADER_BYTES + 4 * self.buckets + (-4 * self.buckets) % 8

    @property
    def keys_offset(self) -> int:
        return self.meta_offset + 8 * self.capacity

    @property
    def file_bytes(self) -> int:
        total = self.keys_offset + self.key_width * self.capacity
        return -(-total // 4096) * 4096

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, self.capacity, self.buckets,
                            self.key_width, self.per_extent, self.stride, self.extent_bytes,
                            0, 0)

    @classmethod
    def unpack(cls, data: bytes) -> Header:
        if len(data) < _HEADER.size:
            raise ValueError(f"not a kvd index: {len(data)} bytes, shorter than its header")
        (magic, version, header_bytes, capacity, buckets, key_width, per_extent, stride,
         extent_bytes, _, _) = _HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION or header_bytes != HEADER_BYTES:
            raise ValueError(f"not a kvd index of version {VERSION} (magic {magic!r}, "
                             f"version {version})")
        return cls(capacity, buckets, key_width, per_extent, stride, extent_bytes)

    @property
    def geometry(self) -> tuple[int, int, int, int, int, int, int, int, int]:
        """Where the regions are and how slots map to offsets, as kvd_proto.native takes it:
        buckets offset, buckets, meta offset, capacity, keys offset, key width, per extent,
        extent bytes, stride."""
        return (self.buckets_offset, self.buckets, self.meta_offset, self.capacity,
                self.keys_offset, self.key_width, self.per_extent, self.extent_bytes,
                self.stride)

    def offset_of(self, slot: int) -> int:
        """The pool offset of a slot id."""
        return slot_offset(slot, self.per_extent, self.extent_bytes, self.stride)


def buckets_for(capacity: int) -> int:
    """A power of two at least twice the capacity (load factor <= 1/2)."""
    n = 1
    while n < 2 * max(1, capacity):
        n <<= 1
    return n
