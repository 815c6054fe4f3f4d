"""The daemon's end of the sessions' channels (kvd_proto/channel.py): the transport only.

A registered session that maps its namespace's index may also ask for a channel (attach role
`channel`): a sealed memory file holding two rings (engine -> daemon, daemon -> engine) and an
eventfd to wake the daemon. `ChannelHub` owns them all and decides when each is read, on the
event loop: at once when woken, then every POLL_INTERVAL_S while the engine keeps sending (so
a busy engine never needs a system call), and after IDLE_AFTER_S of silence it sets the
channel's idle flag and waits for the eventfd again. What a record means is the
`RecordHandler`'s business (kvd_server/channel/service.py).

Everything in the shared file is the engine's to write too, so nothing read from it is
trusted: a broken ring (a position or length that cannot be) ends the session. Work is
bounded per turn (MAX_RECORDS_PER_TURN per channel), and a channel whose engine does not read
its answers (the down ring stays full) is simply not read until it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import mmap
import os
import time
from collections.abc import Callable
from typing import Protocol

from kvd_proto.channel import ChannelHeader, ChannelView, RingError, fence

log = logging.getLogger(__name__)

POLL_MIN_S = 0.001          # channels with records at the last turn are read again this soon
POLL_MAX_S = 0.004          # ... and silent ones no later than this
IDLE_AFTER_S = 0.05         # silent this long: wait for the engine's eventfd instead
MAX_RECORDS_PER_TURN = 256   # per channel, before the loop serves anything else
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class RecordHandler(Protocol):
    """Applies one up record of a session; returns the answer record to write, if any.
    Raises nothing: refusals are answered (REJECTED records). `refill` is asked after every
    turn: a record the daemon sends unasked (its reserve topped up), if any."""

    def __call__(self, session: object, kind: int, payload: bytes) -> bytes | None: ...

    def refill(self, session: object) -> bytes | None: ...


class Channel:
    """One session's channel: the memory file (mapped here read/write), its eventfd, and the
    rings as the daemon sees them (it reads up, writes down)."""

    def __init__(self, session: object, session_id: str,
                 header: ChannelHeader | None = None) -> None:
        self.session = session
        self.session_id = session_id
        self.header = header = header or ChannelHeader()
        fd = os.memfd_create(f"kvd-channel-{session_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, header.file_bytes)
            # The engine maps it read/write, so it may write garbage, but it can never shrink
            # it under the daemon's mapping (a read past the end would be a SIGBUS).
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            self._map = mmap.mmap(fd, header.file_bytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
            self.wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except OSError:
            os.close(fd)
            raise
        self.fd = fd
        self._map[:len(header.pack())] = header.pack()
        self._buf = memoryview(self._map)
        self.view = ChannelView(self._buf, header, engine=False)
        self.last_record = time.monotonic()
        self.closed = False

    def pending(self) -> int:
        return self.view.reader.pending()

    def go_idle(self) -> bool:
        """Set the idle flag (the engine wakes us from now on); False, and stay awake, when a
        record arrived meanwhile (the check after the barrier closes the race)."""
        self.view.set_daemon_idle(True)
        fence()
        if self.view.reader.pending():
            self.view.set_daemon_idle(False)
            return False
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.view.release()
        self._buf.release()
        self._map.close()
        os.close(self.fd)
        os.close(self.wake_fd)


class ChannelHub:
    """Every session's channel and the schedule they are read on (see the module doc)."""

    def __init__(self, handle: RecordHandler, *, on_broken: Callable[[object, str], None],
                 heartbeat: Callable[[object], None],
                 header: ChannelHeader | None = None) -> None:
        self.service = handle
        self.header = header or ChannelHeader()     # every channel's ring sizes
        self._handle = handle
        self._on_broken = on_broken          # end a session that broke its ring's rules
        self._heartbeat = heartbeat          # a session heard from (liveness)
        self._channels: dict[str, Channel] = {}
        self._active: set[Channel] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.Handle | None = None
        self._interval = POLL_MIN_S
        self._granted = False                # a turn's refills granted slots
        self.broken_total = 0

    def __len__(self) -> int:
        return len(self._channels)

    def get(self, session_id: str) -> Channel | None:
        return self._channels.get(session_id)

    # ------------------------------------------------------------------ life cycle
    def open(self, session: object, session_id: str) -> Channel:
        """The session's channel (one per session: asking again hands out the same)."""
        channel = self._channels.get(session_id)
        if channel is not None:
            return channel
        channel = Channel(session, session_id, self.header)
        self._channels[session_id] = channel
        loop = self._event_loop()
        if loop is not None:
            loop.add_reader(channel.wake_fd, self._wake, channel)
        self._wake(channel)
        return channel

    def close(self, session_id: str) -> None:
        """The session ends: apply what it sent before (its last completions), then drop the
        channel. Safe to call for a session without one."""
        channel = self._channels.pop(session_id, None)
        if channel is None:
            return
        self._active.discard(channel)
        # Bounded: a hostile engine could keep appending while we read. What it sent last
        # that cannot be read is dropped.
        with contextlib.suppress(RingError):
            self._read(channel, limit=channel.header.up_bytes // 8, refill=False)
        loop = self._event_loop()
        if loop is not None:
            loop.remove_reader(channel.wake_fd)
        channel.close()

    def send(self, session_id: str, record: bytes) -> bool:
        """Write an answer into the session's down ring now (an answer that came outside a
        turn: FOUND); False when the session has no channel or its ring has no room (the
        engine then waits for the answer no longer than it would for a slow one)."""
        channel = self._channels.get(session_id)
        if channel is None or channel.closed:
            return False
        writer = channel.view.writer
        if writer.free() < 2 * writer.max_record:
            return False
        writer.write(record)
        writer.publish()
        return True

    def close_all(self) -> None:
        for session_id in list(self._channels):
            self.close(session_id)

    def _event_loop(self) -> asyncio.AbstractEventLoop | None:
        if self._loop is None:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                return None                  # no loop (unit tests): read by poll() only
        return self._loop

    # ------------------------------------------------------------------ reading
    def _wake(self, channel: Channel) -> None:
        """The engine woke us (or a channel opened): read it now and keep polling it."""
        with contextlib.suppress(OSError):     # nothing to read: opened, not woken
            os.eventfd_read(channel.wake_fd)
        if channel.closed:
            return
        channel.view.set_daemon_idle(False)
        channel.last_record = time.monotonic()
        self._active.add(channel)
        self._interval = POLL_MIN_S
        self._schedule(0.0)

    def _schedule(self, delay: float) -> None:
        loop = self._event_loop()
        if loop is None:
            return
        if self._timer is not None:
            if delay or self._timer.cancelled():
                return
            self._timer.cancel()            # woken: read now, not at the next tick
        self._timer = loop.call_later(delay, self._turn) if delay else \
            loop.call_soon(self._turn)

    def _turn(self) -> None:
        self._timer = None
        self._granted = False
        read, more = self.poll()
        if more:
            self._schedule(0.0)
            return
        # Slots granted count as activity: an engine stepping with lookups only writes no
        # record, and its reserve still comes back at the quick pace while it is refilled.
        self._interval = POLL_MIN_S if read or self._granted else \
            min(POLL_MAX_S, 2 * self._interval)
        if self._active:
            self._schedule(self._interval)

    def poll(self) -> tuple[int, bool]:
        """Read every awake channel (at most MAX_RECORDS_PER_TURN records each); put the
        silent ones to sleep. (Records read, whether a channel has some left over.)"""
        now = time.monotonic()
        read = 0
        more = False
        for channel in list(self._active):
            try:
                n = self._read(channel, limit=MAX_RECORDS_PER_TURN)
            except RingError as exc:
                self._broken(channel, str(exc))
                continue
            if n:
                read += n
                channel.last_record = now
                if n >= MAX_RECORDS_PER_TURN:
                    more = True
            elif now - channel.last_record > IDLE_AFTER_S and channel.go_idle():
                self._active.discard(channel)
        return read, more

    def _read(self, channel: Channel, limit: int, refill: bool = True) -> int:
        """Apply up to `limit` records, then (`refill`) top the session's reserve up; how
        many records were applied."""
        reader, writer = channel.view.reader, channel.view.writer
        room = 2 * writer.max_record         # an answer, and the filler before it at worst
        handle, session = self._handle.__call__, channel.session
        n = 0
        try:
            while n < limit:
                # Records read in batches, each no more than the down ring has room to answer
                # (a record has one answer at most): the engine reads no answers, wait for it.
                batch = reader.read_all(min(limit - n, writer.free() // room))
                if not batch:
                    break
                for kind, payload in batch:
                    answer = handle(session, kind, payload)
                    n += 1
                    if answer is not None:
                        writer.write(answer)
                        writer.publish()     # the engine may use it before the turn ends
            if refill and writer.free() >= room:
                answer = self._handle.refill(channel.session)
                if answer is not None:
                    writer.write(answer)
                    self._granted = True
        finally:
            reader.commit()
            writer.publish()
        if n:
            self._heartbeat(channel.session)
        return n

    def _broken(self, channel: Channel, why: str) -> None:
        self.broken_total += 1
        log.warning("session %s broke its channel (%s); ending it", channel.session_id, why)
        self._active.discard(channel)
        channel.view.set_daemon_idle(True)
        self._on_broken(channel.session, f"its channel is broken: {why}")
