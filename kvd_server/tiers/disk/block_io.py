"""The disk tier's block reads and writes, a batch per call: compiled (kvd_server/tiers/disk/_blockio.c,
the GIL released for the whole batch) where it was built, else the pure-Python twins here with
the same results. `KVD_NATIVE=0` in the environment forces the twins, as for kvd_proto.native.

Why batches: the tier's I/O threads are Python threads. Block by block, each block gives the
GIL up for its system call and its checksum and must win it back from the daemon's event loop
each time; under load that wait bounds the tier, not the drive. A batch takes the GIL once.

- `write_blocks(fd, [(buffer, offset, length)])`: each whole buffer written at `offset`; per
  item the CRC-32 (zlib's) of its first `length` bytes, or -errno.
- `read_blocks(fd, [(buffer, offset, length, crc, dest)])`: len(buffer) bytes read at `offset`
  into the buffer; per item 1 when its first `length` bytes came whole with checksum `crc`
  (then copied into `dest`, unless None), 0 when short or corrupt, -errno on an error.
- `copy_into(dest, data)`: `dest[:len(data)] = data`, the GIL released during a large copy.
- `crc32(data)`: zlib's CRC-32, compiled (carry-less multiplies where the CPU has them: ~10x
  zlib's table code) or zlib's; the tiers checksum whole blocks with it.
"""

from __future__ import annotations

import errno
import mmap
import os
import zlib
from collections.abc import Callable, Sequence
from typing import Protocol

from kvd_proto.native import compiled

# What the tier hands these calls: its aligned buffers (anonymous mappings), pool slots
# (memoryviews of the mapped pool file) and the blocks' bytes.
Writable = bytearray | memoryview | mmap.mmap
Readable = bytes | Writable
WriteItem = tuple[Readable, int, int]                     # (buffer, offset, length)
ReadItem = tuple[Writable, int, int, int, Writable | None]  # (buffer, offset, length, crc, dest)


class BlockIO(Protocol):
    """What the compiled module (kvd_server/tiers/disk/_blockio.c) exports: the contract its
    twins below keep, call for call (tests/unit/test_block_io.py holds them equal)."""

    def write_blocks(self, fd: int, items: Sequence[WriteItem], /) -> list[int]: ...

    def read_blocks(self, fd: int, items: Sequence[ReadItem], /) -> list[int]: ...

    def crc32(self, data: Readable, /) -> int: ...

    def copy_into(self, dest: Writable, data: Readable, /) -> None: ...


def py_write_blocks(fd: int, items: Sequence[WriteItem]) -> list[int]:
    """The twin of `_blockio.write_blocks`."""
    out = []
    for buf, offset, length in items:
        with memoryview(buf) as view:
            try:
                done = 0
                while done < len(view):
                    n = os.pwritev(fd, [view[done:]], offset + done)
                    if n <= 0:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    done += n
                out.append(zlib.crc32(view[:length]))
            except OSError as exc:
                out.append(-(exc.errno or errno.EIO))
    return out


def py_read_blocks(fd: int, items: Sequence[ReadItem]) -> list[int]:
    """The twin of `_blockio.read_blocks`."""
    out = []
    for buf, offset, length, crc, dest in items:
        with memoryview(buf) as view:
            try:
                got = 0
                while got < len(view):
                    n = os.preadv(fd, [view[got:]], offset + got)
                    if n == 0:
                        break
                    got += n
            except OSError as exc:
                out.append(-(exc.errno or errno.EIO))
                continue
            if got < length or zlib.crc32(view[:length]) != crc:
                out.append(0)
                continue
            if dest is not None:
                dest[:length] = view[:length]
            out.append(1)
    return out


_native: BlockIO | None = compiled("kvd_server.tiers.disk._blockio")
NATIVE = _native is not None
write_blocks: Callable[[int, Sequence[WriteItem]], list[int]] = \
    _native.write_blocks if _native is not None else py_write_blocks
read_blocks: Callable[[int, Sequence[ReadItem]], list[int]] = \
    _native.read_blocks if _native is not None else py_read_blocks
crc32: Callable[[Readable], int] = _native.crc32 if _native is not None else zlib.crc32


def py_copy_into(dest: Writable, data: Readable) -> None:
    """The twin of `_blockio.copy_into`."""
    n = len(data)
    if n > len(dest):
        raise ValueError("copy_into: the data is longer than the destination")
    dest[:n] = data


copy_into: Callable[[Writable, Readable], None] = \
    _native.copy_into if _native is not None else py_copy_into


def error(result: int) -> OSError:
    """The OSError a negative result stands for."""
    return OSError(-result, os.strerror(-result))
