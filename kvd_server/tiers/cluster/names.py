"""What the cluster tier keeps in the store, by name, and how each value is laid out.

- A block: `kvd/v1/b/<namespace>/<key hex>`. The namespace is the daemon's digest of tenant,
  model and layout (kvd_server/core/namespaces.py), so two tenants never share a name, on any
  node. Value: BLOCK_HEADER (magic, CRC-32 of the block, its length), then the block.
- A node's list of the blocks it published in a namespace (its manifest):
  `kvd/v1/m/<namespace>/<node>`. Value: magic, count, then each key as u8 length + bytes.
- The nodes: `kvd/v1/nodes`. Value: magic, count, then each node's name as u8 length + UTF-8.

The store has no listing call, so nodes find each other's blocks through the manifests (each
node rewrites its own every sync interval when it changed, and reads the others'). All
decoders here are strict and bounded: a value another node (or anything else) wrote wrongly
is refused with StoreFormatError, never half-read.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from kvd_server.tiers.disk import block_io

BLOCK_MAGIC = b"KVDB"
MANIFEST_MAGIC = b"KVDM"
NODES_MAGIC = b"KVDN"
BLOCK_HEADER = struct.Struct("<4sIQ")      # magic, crc32, length
_COUNT = struct.Struct("<4sI")             # magic, count
MAX_MANIFEST_KEYS = 1 << 20
MAX_NODES = 4096
NODES = "kvd/v1/nodes"


class StoreFormatError(ValueError):
    """A value in the store that is not what its name says."""


def block_name(namespace: str, key: bytes) -> str:
    return f"kvd/v1/b/{namespace}/{key.hex()}"


def namespace_prefix(namespace: str) -> str:
    """The names of every block of a namespace start so."""
    return f"kvd/v1/b/{namespace}/"


def manifest_name(namespace: str, node: str) -> str:
    return f"kvd/v1/m/{namespace}/{node}"


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


def _encode_list(magic: bytes, items: list[bytes]) -> bytes:
    parts = [_COUNT.pack(magic, len(items))]
    for item in items:
        if not 0 < len(item) <= 255:
            raise ValueError(f"an entry of {len(item)} bytes (1-255)")
        parts.append(bytes((len(item),)) + item)
    return b"".join(parts)


def _decode_list(value: bytes, magic: bytes, bound: int, what: str) -> list[bytes]:
    if len(value) < _COUNT.size:
        raise StoreFormatError(f"{what} shorter than its header")
    got, count = _COUNT.unpack_from(value)
    if got != magic:
        raise StoreFormatError(f"not a kvd {what}")
    if count > bound:
        raise StoreFormatError(f"{what} of {count} entries (at most {bound})")
    out, at = [], _COUNT.size
    for _ in range(count):
        if at >= len(value):
            raise StoreFormatError(f"{what} cut short")
        n = value[at]
        if n == 0 or at + 1 + n > len(value):
            raise StoreFormatError(f"{what}: an entry past its end")
        out.append(bytes(value[at + 1:at + 1 + n]))     # keys: hashable, whatever value is
        at += 1 + n
    if at != len(value):
        raise StoreFormatError(f"{what}: {len(value) - at} bytes after its entries")
    return out


def encode_manifest(keys: Iterable[bytes]) -> bytes:
    return _encode_list(MANIFEST_MAGIC, list(keys)[:MAX_MANIFEST_KEYS])


def decode_manifest(value: bytes) -> list[bytes]:
    return _decode_list(value, MANIFEST_MAGIC, MAX_MANIFEST_KEYS, "manifest")


def encode_nodes(nodes: Iterable[str]) -> bytes:
    return _encode_list(NODES_MAGIC, [n.encode() for n in list(nodes)[:MAX_NODES]])


def decode_nodes(value: bytes) -> list[str]:
    try:
        return [n.decode() for n in _decode_list(value, NODES_MAGIC, MAX_NODES, "node list")]
    except UnicodeDecodeError as exc:
        raise StoreFormatError(f"node list: a name that is not UTF-8 ({exc})") from None
