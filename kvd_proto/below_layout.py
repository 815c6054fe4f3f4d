"""The "held below" table's byte layout (version 1): which keys of a namespace a tier below
the pool holds, as the daemon publishes them and engines read them.

A key the pool does not hold but a tier below it (the local disk, the cluster) does is worth
a HIT_PENDING: the daemon promotes it into the pool, and the engine's next lookups see it
being stored, then ready, in the shared index. Engines must know "held below" without a round
trip, so the daemon keeps, per namespace, a table of 64-bit key fingerprints in a sealed
memory file that every attached engine of the namespace maps read-only (attach role `below`,
docs/attach.md). All integers are little-endian. Regions:

  header   HEADER_BYTES   magic, version, header bytes, buckets (a power of two), flags
                          (u32 at FLAGS_OFFSET), zeros
  buckets  u64[buckets]   a key's fingerprint, or 0 (empty); open addressing, linear probing

A key's fingerprint is `crc32(key) | crc32(reversed key) << 32` (zlib's CRC-32, init 0; 1 in
place of 0); its home bucket is `fingerprint & (buckets - 1)`; probe forward at most
MAX_PROBE buckets, an empty bucket ends the probe. The table is a hint: a fingerprint may be
stale or (rarely) shared by two keys, so a "held below" answer only starts a promotion, which
the daemon checks against the tier's full key; a key the table misses is a MISS. Deletion
shifts later entries of a run back (no tombstones), so a reader racing a delete may miss a
key, never find one that was not written.

The flags word says what an engine does with a key that neither the index nor this table
names (the daemon changes it while engines read it; 0 in a table without a cluster tier):
  FLAG_ASK   the cluster store may hold it: report the key in the step's FIND record (the
             daemon asks the store and answers FOUND; what the store holds is in this table
             by then)
  FLAG_WAIT  and until that answer, the lookup answers "not known yet" (vLLM's RETRY: the
             request waits a step) instead of MISS
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

VERSION = 1
MAGIC = b"KVDBLW01"
HEADER_BYTES = 4096
MAX_PROBE = 64
MIN_BUCKETS = 1024
MAX_BUCKETS = 1 << 24          # 128 MiB of table: 11M keys at the load factor below
LOAD = 1.5                     # buckets per key held, at least

_HEADER = struct.Struct("<8sIIQ")   # magic, version, header bytes, buckets
FLAGS_OFFSET = 24                   # u32 flags, after the header's fields
FLAG_ASK = 1
FLAG_WAIT = 2


def fingerprint(key: bytes) -> int:
    """A key's 64-bit fingerprint (never 0: 0 marks an empty bucket)."""
    fp = zlib.crc32(key) | zlib.crc32(key[::-1]) << 32
    return fp or 1


def buckets_for(keys: int) -> int:
    """A power of two with room for `keys` at the table's load factor, within its bounds."""
    n = MIN_BUCKETS
    while n < LOAD * keys and n < MAX_BUCKETS:
        n <<= 1
    return n


@dataclass(frozen=True, slots=True)
class BelowHeader:
    buckets: int

    @property
    def buckets_offset(self) -> int:
        return HEADER_BYTES

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + 8 * self.buckets

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, self.buckets)

    @classmethod
    def unpack(cls, data: bytes) -> BelowHeader:
        if len(data) < _HEADER.size:
            raise ValueError(f"not a kvd below table: {len(data)} bytes, shorter than its "
                             "header")
        magic, version, header_bytes, buckets = _HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION or header_bytes != HEADER_BYTES:
            raise ValueError(f"not a kvd below table of version {VERSION} (magic {magic!r}, "
                             f"version {version})")
        if not buckets or buckets & (buckets - 1) or buckets > MAX_BUCKETS:
            raise ValueError(f"below table with {buckets} buckets (a power of two up to "
                             f"{MAX_BUCKETS} expected)")
        return cls(buckets)
