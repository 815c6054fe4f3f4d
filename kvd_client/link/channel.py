"""The engine's end of its session's channel (kvd_proto/channel.py): the transport only.

The scheduler thread itself moves every message: `Outbox.flush` appends the step's records to
the up ring and publishes them (a memory copy, a barrier, a store), and writes the daemon's
eventfd only when the daemon said it is idle; `SessionChannel.receive` reads the daemon's
answers from the down ring. No engine thread, lock or system call is needed in the common
case, so a scheduler that never leaves the GIL still reaches the daemon at once.

The `Outbox` keeps records the ring had no room for (the daemon is behind, stopped or gone) in
order, up to a bound, and says which step's records the daemon has read (`acked`). What the
records mean, and the daemon's answers, are the session's (kvd_client/offload/daemon_link.py).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections import deque
from collections.abc import Callable

from kvd_proto.channel import UP_HEAD, ChannelHeader, ChannelView, fence
from kvd_proto.native import eventfd_signal
from kvd_proto.records import GRANTED, DownRecord, RecordError, decode_down

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

    def receive(self, granted: Callable[[bytes], bool] | None = None) -> list[DownRecord]:
        """Every answer the daemon has published since the last call. `granted`, when given,
        takes each GRANTED's payload first (the common answer, applied undecoded: the
        reserve's `granted_record`); one it returns False for is decoded with the rest."""
        out: list[DownRecord] = []
        reader = self.reader
        for item in reader.read_all():
            if granted is not None and item[0] == GRANTED and granted(item[1]):
                continue
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

