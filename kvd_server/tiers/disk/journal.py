"""The disk tier's index, persisted as an append-only journal beside its data file.

Every block the tier holds is one PUT record (where it lies in the data file, its length,
checksum, namespace, tenant and key), written only after the block's bytes are; a dropped
block is one DEL record. Replaying the journal at start rebuilds the index, so the tier
survives the daemon's restart and the machine's reboot (a flusher fsyncs the journal every
second). Each record carries its own CRC: replay stops at the first torn or corrupt record
(the tail a crash cut short) and truncates there. A block whose PUT survived but whose bytes
did not (a power loss reorders writes) fails its checksum when read and is dropped, never
served. When the journal grows past twice what the live records need, it is rewritten
(compacted) to a new file that replaces it atomically.

File layout, little-endian: a header (magic "KVDDISK1", u32 version, u64 data bytes, u64 extent
bytes), then records: u32 length (of the whole record), u32 CRC-32 of what follows it, u8 op,
then PUT: u64 offset, u32 length, u32 slot bytes, u32 block CRC-32, u16 namespace, u16 key, u16
tenant lengths and their bytes; DEL: u64 offset.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAGIC = b"KVDDISK1"
VERSION = 1
_HEADER = struct.Struct("<8sIQQ")
_RECORD = struct.Struct("<II")          # length, crc of the rest
_PUT = struct.Struct("<BQIIIHHH")       # op, offset, length, slot bytes, crc, 3 lengths
_DEL = struct.Struct("<BQ")
PUT, DEL = 1, 2
MAX_RECORD = 4096


@dataclass(slots=True)
class Placed:
    """A block as the journal records it."""

    offset: int
    length: int
    alloc: int
    crc: int
    namespace: str
    key: bytes
    tenant: str


def _write_all(fd: int, data: bytes) -> None:
    """All of `data`, or OSError (a full disk may take part of a write without an error)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, "No space left on device (a write cut short)")
        view = view[n:]


class JournalMismatch(Exception):
    """The journal was written for another data file size or extent size."""


def _put_record(p: Placed) -> bytes:
    ns, tenant = p.namespace.encode(), p.tenant.encode()
    body = _PUT.pack(PUT, p.offset, p.length, p.alloc, p.crc, len(ns), len(p.key),
                     len(tenant)) + ns + p.key + tenant
    return _RECORD.pack(_RECORD.size + len(body), zlib.crc32(body)) + body


def _del_record(offset: int) -> bytes:
    body = _DEL.pack(DEL, offset)
    return _RECORD.pack(_RECORD.size + len(body), zlib.crc32(body)) + body


def _records(data: bytes, start: int) -> Iterator[tuple[int, bytes]]:
    """(end position, body) of each intact record from `start`; stops at the first that is
    torn or corrupt."""
    at = start
    while at + _RECORD.size <= len(data):
        length, crc = _RECORD.unpack_from(data, at)
        if not _RECORD.size < length <= MAX_RECORD or at + length > len(data):
            return
        body = data[at + _RECORD.size:at + length]
        if zlib.crc32(body) != crc:
            return
        at += length
        yield at, body


def _parse(body: bytes) -> Placed | int | None:
    """A PUT's block, a DEL's offset, or None for a record this version cannot read."""
    op = body[0]
    if op == DEL and len(body) == _DEL.size:
        return _DEL.unpack(body)[1]
    if op != PUT or len(body) < _PUT.size:
        return None
    _, offset, length, alloc, crc, ns_len, key_len, tenant_len = _PUT.unpack_from(body)
    at = _PUT.size
    if at + ns_len + key_len + tenant_len != len(body):
        return None
    ns = body[at:at + ns_len].decode(errors="replace")
    key = body[at + ns_len:at + ns_len + key_len]
    tenant = body[at + ns_len + key_len:].decode(errors="replace")
    return Placed(offset, length, alloc, crc, ns, key, tenant)


class Journal:
    """The append-only journal of one disk tier (see the module doc). Not thread-safe: the
    tier calls it under its lock."""

    def __init__(self, path: str, data_bytes: int, extent_bytes: int) -> None:
        self.path = path
        self._header = _HEADER.pack(MAGIC, VERSION, data_bytes, extent_bytes)
        self._fd = -1
        self.bytes = 0                  # the journal file's length
        self.dirty = False              # appended since the last fsync

    def load(self) -> list[Placed]:
        """The blocks the journal holds (and open it for appending). A journal of another
        layout raises JournalMismatch; a missing one starts empty."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = b""
        live: dict[int, Placed] = {}
        end = 0
        if data:
            if data[:_HEADER.size] != self._header:
                raise JournalMismatch(self._describe(data[:_HEADER.size]))
            end = _HEADER.size
            for at, body in _records(data, _HEADER.size):
                end = at
                parsed = _parse(body)
                if isinstance(parsed, Placed):
                    live[parsed.offset] = parsed
                elif isinstance(parsed, int):
                    live.pop(parsed, None)
            if end < len(data):
                log.warning("disk tier journal %s: %d bytes after the last intact record "
                            "dropped (a write cut short)", self.path, len(data) - end)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if not data:
            _write_all(self._fd, self._header)
            end = _HEADER.size
        os.ftruncate(self._fd, end)
        os.lseek(self._fd, end, os.SEEK_SET)
        self.bytes = end
        self.dirty = True
        return list(live.values())

    def _describe(self, header: bytes) -> str:
        if len(header) < _HEADER.size or header[:8] != MAGIC:
            return "not a kvd disk tier journal"
        _, version, data_bytes, extent_bytes = _HEADER.unpack(header)
        return (f"written for version {version}, {data_bytes} data bytes in extents of "
                f"{extent_bytes}")

    def put(self, placed: Placed) -> None:
        self._append(_put_record(placed))

    def put_many(self, placed: list[Placed]) -> None:
        """PUT records for a batch of blocks in one write: all of them, or (OSError) none."""
        if placed:
            self._append(b"".join(map(_put_record, placed)))

    def delete(self, offset: int) -> None:
        self._append(_del_record(offset))

    def _append(self, record: bytes) -> None:
        """One record whole, or none: a write the disk cuts short (full) is taken back, so
        the records appended after it (once there is room again) are not lost behind a torn
        one at the next replay."""
        try:
            _write_all(self._fd, record)
        except OSError:
            os.ftruncate(self._fd, self.bytes)
            os.lseek(self._fd, self.bytes, os.SEEK_SET)
            raise
        self.bytes += len(record)
        self.dirty = True

    def needs_compaction(self, live: int) -> bool:
        """Whether the journal is over twice what `live` blocks need (and past 1 MiB)."""
        return self.bytes > max(1 << 20, 2 * 160 * max(1, live))

    def compact(self, live: Iterable[Placed]) -> None:
        """Rewrite the journal as one PUT per live block, atomically (write, fsync, rename)."""
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            chunk = [self._header]
            size = len(self._header)
            for placed in live:
                record = _put_record(placed)
                chunk.append(record)
                size += len(record)
                if len(chunk) >= 4096:
                    _write_all(fd, b"".join(chunk))
                    chunk = []
            _write_all(fd, b"".join(chunk))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.replace(tmp, self.path)
        os.close(self._fd)
        self._fd = fd
        os.lseek(fd, size, os.SEEK_SET)
        self.bytes = size
        self.dirty = False
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        dfd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def sync(self) -> None:
        """fsync what was appended (the flusher, every second; close)."""
        if self._fd >= 0 and self.dirty:
            os.fsync(self._fd)
            self.dirty = False

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1
