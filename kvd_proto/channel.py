"""A session's channel: two single-producer/single-consumer rings in one shared memory file.

The engine's scheduler thread and the daemon exchange the shared-index protocol's messages
(docs/attach.md, "The channel") through this file, with no thread, lock or system call in the
common case: the engine appends records to the *up* ring and reads the daemon's answers from
the *down* ring at its next step; the daemon does the reverse on its event loop. Layout,
version 1, little-endian:

  header   HEADER_BYTES: magic "KVDCHAN1", u32 version, u32 header bytes, u32 up_bytes, u32
           down_bytes (`ChannelHeader`); then one 64-byte line per control word (`UP_TAIL`
           ...`DAEMON_IDLE`, byte offsets below)
  up       up_bytes (a power of two): records the engine writes, the daemon reads
  down     down_bytes (a power of two): records the daemon writes, the engine reads

Positions (`*_TAIL`, `*_HEAD`) are u64 byte counts since the channel was made: the producer
owns the tail, the consumer the head; `tail - head` bytes are unread, and a position's place
in its ring is `position % ring_bytes`. A record is a u32 length (8-byte header + payload,
unpadded), a u16 kind and a u16 of zeros, then the payload, padded with zeros to a multiple of
8, and at most a quarter of its ring. A record never wraps: a producer short of room before the
ring's end fills it with one PAD record (kind 0) and goes on at the start.

Ordering: the producer writes the record's bytes, then (after a barrier) the tail; the consumer
reads the tail, then the bytes, then writes its head. The wake-up: a consumer that will only
look again when told (the daemon, idle) sets DAEMON_IDLE, issues a full barrier and reads the
tail once more before it sleeps; a producer that published a tail issues a full barrier and,
if DAEMON_IDLE is set, writes 1 to the session's eventfd. Neither side blocks on the other.

Everything the other side writes is untrusted: `RingReader(strict=True)` validates every
position and length and raises `RingError` on a violation (the daemon ends such a session).
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate, repeat
from operator import mod
from typing import Any

from kvd_proto.barrier import fence  # publishing a tail, then reading DAEMON_IDLE, needs one
from kvd_proto.native import ring_read, ring_write

VERSION = 1
MAGIC = b"KVDCHAN1"
HEADER_BYTES = 4096
LINE = 64
# Byte offsets of the control words (each u64 on its own cache line).
UP_TAIL = 1 * LINE          # engine: bytes appended to the up ring
UP_HEAD = 2 * LINE          # daemon: bytes of the up ring consumed
DOWN_TAIL = 3 * LINE        # daemon: bytes appended to the down ring
DOWN_HEAD = 4 * LINE        # engine: bytes of the down ring consumed
DAEMON_IDLE = 5 * LINE      # daemon: 1 while it waits for the eventfd instead of polling

DEFAULT_UP_BYTES = 256 << 10
DEFAULT_DOWN_BYTES = 2 << 20
RECORD_HEADER = struct.Struct("<IHH")
PAD = 0                     # the filler record at a ring's end
ALIGN = 8

_HEADER = struct.Struct("<8sIIII")    # magic, version, header bytes, up bytes, down bytes


class RingError(Exception):
    """The other side broke the ring's rules (a position or length that cannot be)."""


@dataclass(frozen=True, slots=True)
class ChannelHeader:
    up_bytes: int = DEFAULT_UP_BYTES
    down_bytes: int = DEFAULT_DOWN_BYTES

    @property
    def up_max_record(self) -> int:
        """The largest record (padded) the engine may write: a quarter of its ring."""
        return self.up_bytes // 4

    @property
    def down_max_record(self) -> int:
        """The largest record (padded) the daemon writes: a quarter of its ring."""
        return self.down_bytes // 4

    @property
    def up_offset(self) -> int:
        return HEADER_BYTES

    @property
    def down_offset(self) -> int:
        return HEADER_BYTES + self.up_bytes

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.up_bytes + self.down_bytes

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, self.up_bytes, self.down_bytes)

    @classmethod
    def unpack(cls, data: bytes) -> ChannelHeader:
        if len(data) < _HEADER.size:
            raise ValueError("not a kvd channel: shorter than its header")
        magic, version, header_bytes, up, down = _HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION or header_bytes != HEADER_BYTES:
            raise ValueError(f"not a kvd channel of version {VERSION} (magic {magic!r}, "
                             f"version {version})")
        for size in (up, down):
            if size < 4096 or size & (size - 1) or size > 1 << 30:
                raise ValueError(f"channel ring of {size} bytes is not a power of two in "
                                 "4 KiB..1 GiB")
        return cls(up, down)


def padded(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def record(kind: int, payload: bytes) -> bytes:
    """One record: header, payload, zeros to a multiple of 8."""
    n = RECORD_HEADER.size + len(payload)
    return RECORD_HEADER.pack(n, kind, 0) + payload + bytes(-n % ALIGN)


class _Words:
    """The control words of a mapped channel, as one u64 view."""

    def __init__(self, buf: memoryview) -> None:
        self.view = buf[:HEADER_BYTES].cast("Q")

    def get(self, offset: int) -> int:
        return self.view[offset >> 3]

    def set(self, offset: int, value: int) -> None:
        self.view[offset >> 3] = value


class _RingEnd:
    """One side of one ring: its bytes, the two position words, its bounds. `strict` (the
    daemon's side) raises RingError for a position or record that cannot be; the engine's
    side trusts the daemon and only stops."""

    def __init__(self, buf: memoryview, words: _Words, offset: int, size: int,
                 tail_word: int, head_word: int, max_record: int, *, strict: bool) -> None:
        self._data = buf[offset:offset + size]
        self._words = words
        self._size = size
        self._mask = size - 1
        self._tail_word = tail_word
        self._head_word = head_word
        self.max_record = max_record
        self._strict = strict

    def release(self) -> None:
        self._data.release()


class RingWriter(_RingEnd):
    """The producer side of one ring. `write` appends without publishing; `publish` makes
    everything appended visible to the consumer (one barrier and one store)."""

    def __init__(self, *args: Any, strict: bool) -> None:
        super().__init__(*args, strict=strict)
        self.tail = self._words.get(self._tail_word)   # what this side appended (published or not)
        self.published = self.tail

    def free(self) -> int:
        """Bytes that may be appended now (0 when the consumer's head cannot be; a strict
        writer raises RingError instead)."""
        used = self.tail - self._words.get(self._head_word)
        if not 0 <= used <= self._size:
            if self._strict:
                raise RingError(f"the consumer's head is {used} bytes behind the tail of a "
                                f"{self._size}-byte ring")
            return 0
        return self._size - used

    def room_for(self, n: int) -> bool:
        """Whether a record of `n` bytes (padded) can be appended now."""
        at = self.tail & self._mask
        wrap = self._size - at if at + n > self._size else 0
        return wrap + n <= self.free()

    def write(self, data: bytes) -> bool:
        """Append one encoded record (see `record`); False when there is no room now."""
        n = len(data)
        if n > self.max_record or n % ALIGN:
            raise ValueError(f"a record of {n} bytes does not fit this ring's rules "
                             f"(at most {self.max_record}, a multiple of {ALIGN})")
        at = self.tail & self._mask
        wrap = self._size - at if at + n > self._size else 0
        if wrap + n > self.free():
            return False
        if wrap:
            self._data[at:at + RECORD_HEADER.size] = RECORD_HEADER.pack(wrap, PAD, 0)
            self.tail += wrap
            at = 0
        self._data[at:at + n] = data
        self.tail += n
        return True

    def write_many(self, records: list[bytes]) -> list[int]:
        """Append records in order, as many as fit now (one copy per run that does not cross
        the ring's end); the position after each record appended."""
        if not records:
            return []
        lens = list(map(len, records))
        if max(lens) > self.max_record or any(map(mod, lens, repeat(ALIGN))):
            return self._write_runs(records)          # refuses the record that breaks a rule
        # The common cases, with no per-record Python: all of them fit before the ring's end,
        # or the ones that do, a filler, and the rest from the ring's start.
        tail, size = self.tail, self._size
        at = tail & self._mask
        ends = list(accumulate(lens))
        total = ends[-1]
        if at + total <= size:
            if total > self.free():
                return self._write_runs(records)
            self._data[at:at + total] = b"".join(records) if len(records) > 1 else records[0]
            self.tail = tail + total
            return [tail + e for e in ends]
        before = bisect_right(ends, size - at)        # records that fit before the end
        first = ends[before - 1] if before else 0
        wrap = size - at - first                      # the filler's bytes (a multiple of 8)
        if total + wrap > self.free():
            return self._write_runs(records)
        if first:
            self._data[at:at + first] = b"".join(records[:before])
        if wrap:
            self._data[at + first:at + first + RECORD_HEADER.size] = RECORD_HEADER.pack(wrap, PAD, 0)
        self._data[:total - first] = b"".join(records[before:])
        self.tail = tail + total + wrap
        return [tail + e for e in ends[:before]] + [tail + wrap + e for e in ends[before:]]

    def append(self, records: list[bytes]) -> int:
        """`write_many` without the positions: how many records went in (in one compiled
        pass where kvd_proto._native was built; `tail` is where the last one ends)."""
        if ring_write is not None and records:
            done = ring_write(self._data, self.tail, self.free(), self.max_record, records)
            if done is not None:
                count, self.tail = done
                return count
        return len(self.write_many(records))        # and a record that breaks a rule raises

    def _write_runs(self, records: list[bytes]) -> list[int]:
        """`write_many` record by record: runs up to the ring's end, a filler, and on."""
        free = self.free()
        size, mask = self._size, self._mask
        done = 0
        ends: list[int] = []
        while done < len(records):
            at = self.tail & mask
            room = min(free, size - at)          # up to the end of the ring, for this run
            run = 0
            end = done
            while end < len(records):
                n = len(records[end])
                if n > self.max_record or n % ALIGN:
                    raise ValueError(f"a record of {n} bytes does not fit this ring's rules")
                if run + n > room:
                    break
                run += n
                end += 1
            if run:
                self._data[at:at + run] = b"".join(records[done:end]) if end - done > 1 \
                    else records[done]
                position = self.tail
                for i in range(done, end):
                    position += len(records[i])
                    ends.append(position)
                self.tail += run
                free -= run
                done = end
                continue
            # The next record does not fit before the end: a filler, then on from the start.
            wrap = size - at
            if end == len(records) or wrap + len(records[end]) > free or at == 0:
                break
            self._data[at:at + RECORD_HEADER.size] = RECORD_HEADER.pack(wrap, PAD, 0)
            self.tail += wrap
            free -= wrap
        return ends

    def publish(self) -> bool:
        """Make the appended records visible; True when there was anything to publish."""
        if self.tail == self.published:
            return False
        fence()          # the bytes before the tail (a release; x86 orders them anyway)
        self._words.set(self._tail_word, self.tail)
        self.published = self.tail
        return True


class RingReader(_RingEnd):
    """The consumer side of one ring. `read` returns the next record (kind, payload bytes
    copied out of the shared memory, so the producer cannot change them under the caller);
    `commit` hands what was read back to the producer."""

    def __init__(self, *args: Any, strict: bool) -> None:
        super().__init__(*args, strict=strict)
        self.head = self._words.get(self._head_word)
        self.committed = self.head

    def pending(self) -> int:
        """Bytes published and not read yet."""
        n = self._words.get(self._tail_word) - self.head
        if not 0 <= n <= self._size:
            if self._strict:
                raise RingError(f"the producer's tail is {n} bytes past the head of a "
                                f"{self._size}-byte ring")
            return 0
        return n

    def read(self) -> tuple[int, bytes] | None:
        """The next record, or None when none is published. PAD records are skipped."""
        while True:
            available = self.pending()
            if available < RECORD_HEADER.size:
                if available and self._strict:
                    raise RingError(f"{available} bytes published, less than a record")
                return None
            at = self.head & self._mask
            length, kind, _ = RECORD_HEADER.unpack_from(self._data, at)
            size = padded(length)
            if kind == PAD:
                if at + length != self._size or length % ALIGN or length > available:
                    if self._strict:
                        raise RingError(f"a filler record of {length} bytes at {at} does "
                                        "not end the ring")
                    return None
                self.head += length
                continue
            if length < RECORD_HEADER.size or size > self.max_record or at + size > self._size \
                    or size > available:
                if self._strict:
                    raise RingError(f"a record of {length} bytes at {at} (with {available} "
                                    f"published, at most {self.max_record} a record)")
                return None
            payload = bytes(self._data[at + RECORD_HEADER.size:at + length])
            self.head += size
            return kind, payload

    def read_all(self, limit: int = -1) -> list[tuple[int, bytes]]:
        """Every record published now (at most `limit` when it is >= 0), in order (`read`
        until None; one compiled pass where kvd_proto._native was built). A strict reader
        that meets a record that cannot be returns the ones before it, and raises RingError
        on the next call."""
        if ring_read is None:
            out: list[tuple[int, bytes]] = []
            while len(out) != limit:
                try:
                    item = self.read()
                except RingError:
                    if out:
                        return out
                    raise
                if item is None:
                    return out
                out.append(item)
            return out
        records, self.head, error = ring_read(self._data, self.head,
                                              self._words.get(self._tail_word),
                                              self.max_record, self._strict, limit)
        if error is not None and self._strict and not records:
            raise RingError(error)
        return records

    def commit(self) -> None:
        if self.head != self.committed:
            self._words.set(self._head_word, self.head)
            self.committed = self.head


class ChannelView:
    """Both rings of a mapped channel, from one side: `engine=True` writes up and reads down
    (trusting the daemon), the daemon (`engine=False`) reads up and writes down, strictly."""

    def __init__(self, buf: memoryview, header: ChannelHeader, *, engine: bool) -> None:
        self.header = header
        self.words = _Words(buf)
        strict = not engine
        up = (buf, self.words, header.up_offset, header.up_bytes, UP_TAIL, UP_HEAD,
              header.up_max_record)
        down = (buf, self.words, header.down_offset, header.down_bytes, DOWN_TAIL, DOWN_HEAD,
                header.down_max_record)
        if engine:
            self.writer = RingWriter(*up, strict=False)
            self.reader = RingReader(*down, strict=False)
        else:
            self.reader = RingReader(*up, strict=strict)
            self.writer = RingWriter(*down, strict=strict)

    @property
    def daemon_idle(self) -> bool:
        return self.words.get(DAEMON_IDLE) != 0

    def set_daemon_idle(self, idle: bool) -> None:
        self.words.set(DAEMON_IDLE, 1 if idle else 0)

    def release(self) -> None:
        self.writer.release()
        self.reader.release()
        self.words.view.release()
