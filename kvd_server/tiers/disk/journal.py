"""The disk tier's index, persisted as an append-only journal beside its data file.

Every block the tier holds is one PUT record (where it lies in the data file, its length,
checksum, namespace, tenant and key), written only after the block's bytes are; a dropped
block is one DEL record. Replaying the journal at start rebuilds the index, so the tier
survives the daemon's restart and the machine's reboot (a flusher fsyncs the journal every
second). A block whose PUT survived but whose bytes did not (a power loss reorders writes)
fails its checksum when read and is dropped, never served. When the journal grows past twice
what the live records need, it is rewritten (compacted) to a new file that replaces it
atomically.

Damage costs only what it touches. Each record starts with a mark and a head that carries its
own CRC besides the body's: a record whose body is corrupt is skipped by its (checked) length;
one whose head is corrupt (its length cannot be trusted) is skipped by looking for the next
mark whose head checks. Only a head that checks can move replay on, so a stray byte never
makes replay read a record's body as records. Bad bytes followed by an intact record are a
corrupt record (WARNING "corrupt record at offset N"; the journal is then rewritten without
them); bad bytes up to the end, with nothing intact after them, are the tail a crash cut short
("a write cut short"), truncated. A lost DEL may bring back a block that was dropped: its
bytes are still checked against its CRC when read, so it is the block's own or it is not
served. A damaged file header loses the whole journal (the tier starts empty, WARNING).

File layout, little-endian: a header (magic "KVDDISK1", u32 version, u64 data bytes, u64 extent
bytes), then records. Version 2 (written): a head of 4 bytes "KVDr", u32 length (of the whole
record), u32 CRC-32 of the body, u32 CRC-32 of the head's first 12 bytes; then the body. Version
1 (read, then rewritten as version 2): a head of u32 length, u32 CRC-32 of the body; replay
stops at its first bad record. The body, both versions: u8 op, then PUT: u64 offset, u32
length, u32 slot bytes, u32 block CRC-32, u16 namespace, u16 key, u16 tenant lengths and their
bytes; DEL: u64 offset.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MAGIC = b"KVDDISK1"
VERSION = 2                             # written; 1 is still read (then rewritten)
_HEADER = struct.Struct("<8sIQQ")
_RECORD_V1 = struct.Struct("<II")       # version 1: length, crc of the rest
MARK = b"KVDr"
_HEAD = struct.Struct("<4sIII")         # mark, length, crc of the body, crc of the 12 before
_HEAD_CHECKED = _HEAD.size - 4
_PUT = struct.Struct("<BQIIIHHH")       # op, offset, length, slot bytes, crc, 3 lengths
_DEL = struct.Struct("<BQ")
PUT, DEL = 1, 2
MAX_RECORD = 4096
MAX_SAID = 8                            # corrupt stretches logged one by one, then counted


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


@dataclass(slots=True)
class Replay:
    """What replaying a journal file found: the records' bodies, the corrupt stretches between
    intact records (offset, bytes), and where the last intact record ends (a torn tail after
    it is cut)."""

    bodies: list[bytes] = field(default_factory=list)
    corrupt: list[tuple[int, int]] = field(default_factory=list)
    end: int = 0


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


def _framed(body: bytes) -> bytes:
    """A version 2 record: its checked head, then `body`."""
    head = struct.pack("<4sII", MARK, _HEAD.size + len(body), zlib.crc32(body))
    return head + struct.pack("<I", zlib.crc32(head)) + body


def _put_record(p: Placed) -> bytes:
    ns, tenant = p.namespace.encode(), p.tenant.encode()
    return _framed(_PUT.pack(PUT, p.offset, p.length, p.alloc, p.crc, len(ns), len(p.key),
                             len(tenant)) + ns + p.key + tenant)


def _del_record(offset: int) -> bytes:
    return _framed(_DEL.pack(DEL, offset))


def _records_v1(data: bytes, start: int) -> Replay:
    """Version 1: each intact record from `start`, up to the first that is torn or corrupt
    (its length cannot be told from a corrupt one: nothing after it is read)."""
    out = Replay(end=start)
    at = start
    while at + _RECORD_V1.size <= len(data):
        length, crc = _RECORD_V1.unpack_from(data, at)
        if not _RECORD_V1.size < length <= MAX_RECORD or at + length > len(data):
            break
        body = data[at + _RECORD_V1.size:at + length]
        if zlib.crc32(body) != crc:
            break
        at += length
        out.bodies.append(body)
        out.end = at
    return out


def _head_at(data: bytes, at: int) -> int:
    """The length of the record whose head at `at` checks (mark, head CRC, a sane length that
    fits the file), else 0."""
    if at + _HEAD.size > len(data) or data[at:at + 4] != MARK:
        return 0
    _, length, _, head_crc = _HEAD.unpack_from(data, at)
    if zlib.crc32(data[at:at + _HEAD_CHECKED]) != head_crc:
        return 0
    if not _HEAD.size < length <= MAX_RECORD or at + length > len(data):
        return 0
    return length


def _next_head(data: bytes, at: int) -> int:
    """The first position from `at` where a record's head checks, else -1."""
    while True:
        at = data.find(MARK, at)
        if at < 0 or _head_at(data, at):
            return at
        at += 1


def _records_v2(data: bytes, start: int) -> Replay:
    """Version 2: every intact record from `start`, resynchronising past damage (module doc);
    the stretches skipped between intact records are the corrupt ones."""
    out = Replay(end=start)
    at, bad = start, -1                 # bad: where bytes not yet accounted for begin
    while at < len(data):
        length = _head_at(data, at)
        if not length:                  # no head that checks here: find the next one
            if bad < 0:
                bad = at
            at = _next_head(data, at + 1)
            if at < 0:
                break
            continue
        body = data[at + _HEAD.size:at + length]
        if zlib.crc32(body) != _HEAD.unpack_from(data, at)[2]:
            if bad < 0:                 # the head checks: its length is the record's
                bad = at
            at += length
            continue
        if bad >= 0:
            out.corrupt.append((bad, at - bad))
            bad = -1
        out.bodies.append(body)
        at += length
        out.end = at
    return out


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
        self._data_bytes = data_bytes
        self._extent_bytes = extent_bytes
        self._fd = -1
        self.bytes = 0                  # the journal file's length
        self.dirty = False              # appended since the last fsync
        self.read_only = False          # loaded for reading only: appends refused

    def load(self, read_only: bool = False) -> list[Placed]:
        """The blocks the journal holds (and, unless `read_only`, open it for appending). A
        journal of another layout raises JournalMismatch; a missing one starts empty. A
        corrupt record costs itself (logged with its offset; the journal is rewritten without
        it), a torn tail is cut; `read_only` changes nothing on the disk."""
        self.read_only = read_only
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = b""
        live: dict[int, Placed] = {}
        replay = Replay(end=0)
        version = VERSION
        if data:
            version = self._version(data[:_HEADER.size])
            replay = (_records_v1 if version == 1 else _records_v2)(data, _HEADER.size)
            for body in replay.bodies:
                parsed = _parse(body)
                if isinstance(parsed, Placed):
                    live[parsed.offset] = parsed
                elif isinstance(parsed, int):
                    live.pop(parsed, None)
            self._say(replay, len(data))
        placed = list(live.values())
        if read_only:
            self.bytes = len(data)
            return placed
        if data and (replay.corrupt or version != VERSION):
            try:
                self._rewrite(placed)
            except OSError as exc:
                if version != VERSION:      # records of two framings cannot share a file
                    raise
                log.warning("disk tier journal %s: not rewritten without its corrupt records "
                            "(%s): they are skipped again at the next start", self.path, exc)
            else:
                if version != VERSION:
                    log.info("disk tier journal %s: version %d, rewritten as version %d",
                             self.path, version, VERSION)
                if replay.corrupt:
                    log.warning("disk tier journal %s: rewritten without its %d corrupt "
                                "record(s)", self.path, len(replay.corrupt))
                return placed
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        end = replay.end
        if not data:
            _write_all(self._fd, self._header)
            end = _HEADER.size
        os.ftruncate(self._fd, end)
        os.lseek(self._fd, end, os.SEEK_SET)
        self.bytes = end
        self.dirty = True
        return placed

    def _say(self, replay: Replay, size: int) -> None:
        """One WARNING per corrupt stretch (the first few), and one for a torn tail."""
        for offset, skipped in replay.corrupt[:MAX_SAID]:
            log.warning("disk tier journal %s: corrupt record at offset %d (%d bytes skipped):"
                        " the block it recorded is forgotten, the records after it kept",
                        self.path, offset, skipped)
        if len(replay.corrupt) > MAX_SAID:
            log.warning("disk tier journal %s: %d more corrupt records skipped", self.path,
                        len(replay.corrupt) - MAX_SAID)
        if replay.end < size:
            log.warning("disk tier journal %s: %d bytes after the last intact record "
                        "dropped (a write cut short)", self.path, size - replay.end)

    def _version(self, header: bytes) -> int:
        """The version of a journal written for this layout, else JournalMismatch."""
        if len(header) < _HEADER.size or header[:8] != MAGIC:
            raise JournalMismatch("not a kvd disk tier journal")
        _, version, data_bytes, extent_bytes = _HEADER.unpack(header)
        if version not in (1, VERSION) or (data_bytes, extent_bytes) != (
                self._data_bytes, self._extent_bytes):
            raise JournalMismatch(f"written for version {version}, {data_bytes} data bytes in "
                                  f"extents of {extent_bytes}")
        return int(version)

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
        if self._fd < 0:
            raise OSError(errno.EROFS if self.read_only else errno.EBADF,
                          "the journal is open for reading only" if self.read_only
                          else "the journal is closed")
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
        return not self.read_only and self.bytes > max(1 << 20, 2 * 160 * max(1, live))

    def compact(self, live: Iterable[Placed]) -> None:
        """Rewrite the journal as one PUT per live block, atomically (write, fsync, rename)."""
        self._rewrite(live)

    def _rewrite(self, live: Iterable[Placed]) -> None:
        """Replace the journal with one PUT per block of `live` (written to a new file,
        fsynced, renamed over it, the directory fsynced), then append to the new one."""
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
        if self._fd >= 0:
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

    def fileno(self) -> int:
        """The descriptor appended to (-1: none, read-only or closed): the tier checks it is
        still linked (kvd_server/tiers/disk/tier.py)."""
        return self._fd

    def sync(self) -> None:
        """fsync what was appended (the flusher, every second; close)."""
        if self._fd >= 0 and self.dirty:
            os.fsync(self._fd)
            self.dirty = False

    def close(self) -> None:
        if self._fd >= 0:
            try:
                self.sync()
            finally:
                os.close(self._fd)
                self._fd = -1

