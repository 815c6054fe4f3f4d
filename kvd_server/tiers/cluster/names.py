"""What the cluster tier keeps in the store, by name, and how each value is laid out.

- A block: `kvd/v1/b/<namespace>/<key hex>`. The namespace is the daemon's digest of tenant,
  model and layout (kvd_server/core/namespaces.py), so two tenants never share a name, on any
  node. Value: BLOCK_HEADER (magic, CRC-32 of the block, its length), then the block.

Nothing else: a node that wants a key asks the store about its name (kvd_server/tiers/cluster/
directory.py), so nodes keep no lists of each other's blocks and no list of nodes. The
decoder is strict: a value another node (or anything else) wrote wrongly is refused with
StoreFormatError, never half-read.
"""

from __future__ import annotations

import struct

from kvd_server.tiers.disk import block_io

BLOCK_MAGIC = b"KVDB"
BLOCK_HEADER = struct.Struct("<4sIQ")      # magic, crc32, length


class StoreFormatError(ValueError):
    """A value in the store that is not what its name says."""


def block_name(namespace: str, key: bytes) -> str:
    return f"kvd/v1/b/{namespace}/{key.hex()}"


def namespace_prefix(namespace: str) -> str:
    """The names of every block of a namespace start so."""
    return f"kvd/v1/b/{namespace}/"


def encode_block(data: memoryview | bytes) -> bytes:
    return BLOCK_HEADER.pack(BLOCK_MAGIC, block_io.crc32(data), len(data)) + bytes(data)


def check_block(value: bytes) -> memoryview:
    """The block a value holds, its checksum verified."""
    if len(value) < BLOCK_HEADER.size:
        raise StoreFormatError("a block value shorter than its header")
    magic, crc, length = BLOCK_HEADER.unpack_from(value)
    if magic != BLOCK_MAGIC:
        raise StoreFormatError("not a kvd block")
    data = memoryview(value)[BLOCK_HEADER.size:]
    if len(data) != length:
        raise StoreFormatError(f"a block of {len(data)} bytes says {length}")
    if block_io.crc32(data) != crc:
        raise StoreFormatError("a block failed its checksum")
    return data
