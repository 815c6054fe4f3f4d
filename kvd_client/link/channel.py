"""The engine's end of its session's channel (kvd_proto/channel.py): the transport only.

The scheduler thread itself moves every message: `Outbox.flush` appends the step's records to
the up ring and publishes them (a memory copy, a barrier, a store), and writes the daemon's
eventfd only when the daemon said it is idle; `SessionChannel.receive` reads the daemon's
answers from the down ring. No engine thread, lock or system call is needed in the common
case, so a scheduler that never leaves the GIL still reaches the daemon at once.

The `Outbox` keeps records the ring had no room for (the daemon is behind, stopped or gone) in
order, up to a bound, and says which step's records the daemon has read (`acked`).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from collections import deque

from kvd_proto.channel import UP_HEAD, ChannelHeader, ChannelView, fence
from kvd_proto.native import eventfd_signal
from kvd_proto.records import UP_KINDS, DownRecord, RecordError, Rejected, decode_down

log = logging.getLogger(__name__)

MAX_WAITING_BYTES = 64 << 20     # records the ring had no room for; past it, the session ends


class SessionChannel:
    """A mapped channel (owns both descriptors: the memory file and the daemon's eventfd)."""

    def __init__(self, fd: int, wake_fd: int) -> None:
        self.fd = fd
        self.wake_fd = wake_fd
        size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.header = ChannelHeader.unpack(self._map[:64])
        if self.header.file_bytes > size:
            self._map.close()
            raise ValueError(f"channel file of {size} bytes is smaller than its layout says")
        self._buf = memoryview(self._map)
        self.view = ChannelView(self._buf, self.header, engine=True)
        self.writer = self.view.writer
        self.reader = self.view.reader
        self.wakes = 0

    @property
    def read_position(self) -> int:
        """How far the daemon has read the up ring (a position of `writer.tail`)."""
        return self.view.words.get(UP_HEAD)

    def publish(self) -> None:
        """Make what was appended visible; wake the daemon if it waits for that."""
        if self.writer.publish():
            fence()                   # the tail before the flag: the daemon's check mirrors it
            if self.view.daemon_idle:
                self.wakes += 1
                with contextlib.suppress(OSError):   # a full counter still wakes it
                    eventfd_signal(self.wake_fd)     # keeps the GIL (kvd_proto/native.py)

    def receive(self) -> list[DownRecord]:
        """Every answer the daemon has published since the last call."""
        out: list[DownRecord] = []
        reader = self.reader
        for item in reader.read_all():
            try:
                out.append(decode_down(*item))
            except RecordError as exc:     # a newer daemon's answer: skip it
                log.warning("kvd: skipped an answer this client cannot read (%s)", exc)
        reader.commit()
        return out

    def close(self) -> None:
        self.view.release()
        self._buf.release()
        with contextlib.suppress(BufferError):
            self._map.close()
        for fd in (self.fd, self.wake_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.wake_fd = -1


class _Step:
    """One engine step's records not in the ring yet, in order."""

    __slots__ = ("seq", "records", "essential", "size")

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.records: list[bytes] = []
        self.essential = False
        self.size = -1              # bytes of `records` (-1: not counted since the last put)


class Outbox:
    """Records on their way into a channel, by the engine step (`seq`) they belong to;
    `acked` is the last step whose every record the daemon has read. Kept per step, not per
    record: a step's records go into the ring with one copy and no per-record Python."""

    def __init__(self) -> None:
        # Steps whose records are not (all) in the ring yet. Essential records are the ones
        # an engine waits for (all but grant requests, counters and returned slots).
        self._waiting: deque[_Step] = deque()
        self._waiting_bytes = 0
        # (seq, end position of its last record written, essential): what the daemon has to
        # read before it has read that step's records
        self._written: deque[tuple[int, int, bool]] = deque()
        self.sent = 0                                           # records written, ever

    def _step(self, seq: int) -> _Step:
        waiting = self._waiting
        if waiting and waiting[-1].seq == seq:
            return waiting[-1]
        step = _Step(seq)
        waiting.append(step)
        return step

    def put(self, seq: int, data: bytes, essential: bool = True) -> None:
        self.put_many(seq, [data], essential)

    def put_many(self, seq: int, records: list[bytes], essential: bool = True) -> None:
        """Queue records for step `seq` (the hot path: no per-record work; sizes are counted
        when a flush leaves some waiting)."""
        waiting = self._waiting
        step = waiting[-1] if waiting and waiting[-1].seq == seq else self._step(seq)
        step.records += records
        step.size = -1
        if essential:
            step.essential = True

    @property
    def overflowing(self) -> bool:
        return self._waiting_bytes > MAX_WAITING_BYTES

    def waiting(self) -> int:
        return sum(len(step.records) for step in self._waiting)

    def flush(self, channel: SessionChannel) -> int:
        """Append what fits, in order, and publish it; how many records are still waiting."""
        waiting, written, writer = self._waiting, self._written, channel.writer
        while waiting:
            step = waiting[0]
            n = writer.append(step.records)
            if n:
                written.append((step.seq, writer.tail, step.essential))
                self.sent += n
            if n < len(step.records):
                if n and step.size >= 0:
                    step.size -= sum(map(len, step.records[:n]))
                del step.records[:n]
                break
            waiting.popleft()
        channel.publish()
        if not waiting:
            self._waiting_bytes = 0
            return 0
        # What the ring had no room for (the daemon is behind): its bytes bound it. Each
        # step is counted once while it waits (the hot path counts nothing).
        for step in waiting:
            if step.size < 0:
                step.size = sum(map(len, step.records))
        self._waiting_bytes = sum(step.size for step in waiting)
        return self.waiting()

    def acked(self, channel: SessionChannel | None, current: int) -> int:
        """The last step (< `current`, the step being built) the daemon has read entirely."""
        written = self._written
        if channel is not None:
            head = channel.read_position
            while written and written[0][1] <= head:
                written.popleft()
        floor = current
        if written:
            floor = min(floor, written[0][0])
        if self._waiting:
            floor = min(floor, self._waiting[0].seq)
        return floor - 1

    def unread(self, channel: SessionChannel | None) -> bool:
        """Essential records the daemon has not read yet (written or still waiting)."""
        written = self._written
        if channel is not None:
            head = channel.read_position
            while written and written[0][1] <= head:
                written.popleft()
        return any(e for _, _, e in written) or any(s.essential for s in self._waiting)

    def clear(self) -> None:
        self._waiting.clear()
        self._waiting_bytes = 0
        self._written.clear()


class Messenger:
    """A session's side of its channel for one connection: the records of the step being
    made (`seq`), put in order and flushed at its end; what the daemon has read (`acked`);
    and its answers. Without a channel (not connected) records are dropped: a new session
    starts from scratch."""

    def __init__(self) -> None:
        self.outbox = Outbox()
        self.channel: SessionChannel | None = None
        self.seq = 0                  # the step whose records are being made
        self.acked = -1               # the last step whose records the daemon has read
        self.essential = False        # this step made a record the engine waits for
        self.rejected = 0             # records the daemon refused (a bug here, or stale)
        self._last_warning = 0.0

    @property
    def sent(self) -> int:
        return self.outbox.sent

    def attach(self, channel: SessionChannel | None) -> None:
        """A new connection's channel (None: none); what was waiting for the old is gone."""
        self.outbox.clear()
        self.channel = channel

    def put(self, records: list[bytes], essential: bool = True) -> None:
        if self.channel is None:
            return
        self.outbox.put_many(self.seq, records, essential)
        self.essential |= essential

    def flush(self) -> bool:
        """Into the ring what fits; False when so much waits that the daemon cannot be
        reading (the caller restarts the session)."""
        if self.channel is None:
            return True
        self.outbox.flush(self.channel)
        return not self.outbox.overflowing

    def next_step(self) -> None:
        self.seq += 1
        self.essential = False

    def receive(self) -> list[DownRecord]:
        """The daemon's answers since the last call; `acked` moves with what it read. A
        refused record is counted and logged (at most every 10 s): the rest goes on."""
        if self.channel is None:
            return []
        answers = self.channel.receive()
        self.acked = self.outbox.acked(self.channel, self.seq)
        for answer in answers:
            if isinstance(answer, Rejected):
                self.rejected += 1
                now = time.monotonic()
                if now - self._last_warning > 10:
                    self._last_warning = now
                    log.warning("kvd rejected a %s message: %s: %s (%d so far)",
                                UP_KINDS.get(answer.kind, answer.kind), answer.code,
                                answer.message, self.rejected)
        return answers

    def unread(self) -> bool:
        """Records the engine waits for that the daemon has not read (flushing any that
        were waiting for room)."""
        if self.channel is not None and self.outbox.waiting():
            self.outbox.flush(self.channel)
        return self.outbox.unread(self.channel)
