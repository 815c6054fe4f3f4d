"""The gRPC socket's front door: who may hold how many connections, and for how long.

gRPC's server accepts every connection and knows nothing of its peer on a Unix socket, so one
local user could open connections until the daemon runs out of descriptors, and then nobody
could attach or ask for health. The daemon therefore owns the public socket itself: it reads
each peer's uid (SO_PEERCRED), refuses a uid past `server.max_connections_per_uid`, closes a
connection that says nothing for `server.idle_timeout` (and one that never says anything
after 10 s, or the idle timeout if shorter), and pipes the rest to the gRPC server on a socket in a private directory. At the
descriptor limit it sheds the connection that has been idle longest, so health and attach
keep working. The cost is one more hop through the event loop per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
import struct
import time
from collections import Counter

log = logging.getLogger(__name__)

SILENT_TIMEOUT_S = 10.0   # a connection that has sent nothing at all by then is dropped
RESERVED_FDS = 64         # descriptors kept for everything else (pool files, attach, logs)
FDS_PER_CONNECTION = 3    # the client's, ours towards gRPC, gRPC's accepted end
HIGH_WATER = 1 << 20      # bytes buffered towards one side before the other is paused
CHECK_INTERVAL_S = 1.0
LINGER_POLL_S = 0.01


class _Side(asyncio.Protocol):
    """One end of a piped connection; writes what it receives to its partner."""

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.transport: asyncio.WriteTransport | None = None
        self.partner: _Side | None = None
        self._pending: list[bytes] = []        # received before the partner was connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are Transport-like
        transport.set_write_buffer_limits(high=HIGH_WATER)

    def deliver(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            self._pending.append(data)
        else:
            self.transport.write(data)

    def flush(self) -> None:
        if self._pending and self.transport is not None:
            for data in self._pending:
                self.transport.write(data)
            self._pending.clear()

    def data_received(self, data: bytes) -> None:
        self.conn.last_active = time.monotonic()
        if self is self.conn.client:
            self.conn.spoke = True
            if self.conn.finishing:        # gRPC reads no more: what the client says goes
                return
        if self.partner is not None:
            self.partner.deliver(data)

    def pause_writing(self) -> None:       # our buffer towards the peer is full
        if self.partner is not None and self.partner.transport is not None:
            self.partner.transport.pause_reading()  # type: ignore[attr-defined]

    def resume_writing(self) -> None:
        if self.partner is not None and self.partner.transport is not None:
            self.partner.transport.resume_reading()  # type: ignore[attr-defined]

    def connection_lost(self, exc: BaseException | None) -> None:
        if self is self.conn.server and self.conn.finishing and self.conn.let_client_end():
            return
        self.conn.close()


class _Connection:
    """A client connection and its pipe to the gRPC server."""

    def __init__(self, door: FrontDoor, uid: int) -> None:
        self.door = door
        self.uid = uid
        self.opened = self.last_active = time.monotonic()
        self.spoke = False
        self.client = _Side(self)
        self.server = _Side(self)
        self.client.partner, self.server.partner = self.server, self.client
        self.closed = False
        self.finishing = False     # the door is closing: gRPC is told no more is coming

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for side in (self.client, self.server):
            if side.transport is not None:
                side.transport.close()
        self.door.forget(self)

    def finish(self) -> None:
        """Close gracefully: half-close towards gRPC, which then closes its end after what it
        has written; that reaches the client, then end of file (let_client_end)."""
        server = self.server.transport
        if self.closed or server is None or server.is_closing() or not server.can_write_eof():
            self.close()
            return
        self.finishing = True
        server.write_eof()

    def let_client_end(self) -> bool:
        """gRPC's end closed while finishing: half-close towards the client and leave the
        client's end open until the client closes it (the door's linger bounds the wait).
        Closed outright, the client's next write (a settings or ping ack after the answer)
        fails with EPIPE, and gRPC then fails the call whose answer it had not yet read
        ("Stream removed (sendmsg: Broken pipe)"). False if the client's end cannot be
        half-closed."""
        client = self.client.transport
        if self.closed or client is None or client.is_closing() or not client.can_write_eof():
            return False
        client.write_eof()
        return True


class FrontDoor:
    """Accepts on the public gRPC socket and pipes each connection to `backend`."""

    def __init__(self, path: str, mode: int, backend: str, *, per_uid: int,
                 idle_timeout: float) -> None:
        self.path = path
        self.mode = mode
        self.backend = backend
        self.per_uid = per_uid
        self.idle_timeout = idle_timeout
        self._sock: socket.socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._conns: set[_Connection] = set()
        self._by_uid: Counter[int] = Counter()
        # Connections refused at the per-uid limit, closed idle, shed at the descriptor
        # limit (`kvd stats`: connections).
        self.refused_total = 0
        self.idle_closed_total = 0
        self.shed_total = 0
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        # Past this many connections the idlest is closed before a new one is piped, so the
        # daemon never runs out of descriptors for health, attach or its own files.
        self.max_connections = max(8, (soft - RESERVED_FDS) // FDS_PER_CONNECTION)

    async def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.path)
            os.chmod(self.path, self.mode)
            sock.listen(512)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._sock = sock
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._accept_loop(), name="kvd-front-door"),
                       loop.create_task(self._idle_loop(), name="kvd-front-door-idle")]

    @property
    def connections(self) -> int:
        return len(self._conns)

    def forget(self, conn: _Connection) -> None:
        if conn in self._conns:
            self._conns.discard(conn)
            self._by_uid[conn.uid] -= 1
            if self._by_uid[conn.uid] <= 0:
                del self._by_uid[conn.uid]

    def shed(self) -> bool:
        """Close the connection idle the longest (the descriptor limit is reached); True if
        there was one."""
        if not self._conns:
            return False
        victim = min(self._conns, key=lambda c: c.last_active)
        victim.close()
        self.shed_total += 1
        return True

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                sock, _ = await loop.sock_accept(self._sock)
            except asyncio.CancelledError:
                raise
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    # Out of descriptors: make room so the next caller (health, an engine)
                    # gets in; the idlest connection is the one to go.
                    if not self.shed():
                        await asyncio.sleep(0.05)
                    continue
                log.warning("accept on %s failed: %s", self.path, exc)
                await asyncio.sleep(0.05)
                continue
            self._admit(loop, sock)

    def _admit(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", raw)
        except OSError:
            sock.close()
            return
        if self._by_uid[uid] >= self.per_uid:
            self.refused_total += 1
            if self.refused_total % 1000 == 1:
                log.warning("uid %d holds %d connections to %s already "
                            "(server.max_connections_per_uid); refusing more", uid,
                            self._by_uid[uid], self.path)
            sock.close()
            return
        while len(self._conns) >= self.max_connections and self.shed():
            pass
        conn = _Connection(self, uid)
        self._conns.add(conn)
        self._by_uid[uid] += 1
        loop.create_task(self._connect(loop, sock, conn))

    async def _connect(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                       conn: _Connection) -> None:
        try:
            await loop.connect_accepted_socket(lambda: conn.client, sock)
            await loop.create_unix_connection(lambda: conn.server, self.backend)
        except OSError as exc:
            log.debug("could not pipe a connection to the gRPC server: %s", exc)
            conn.close()
            sock.close()
            return
        if conn.closed:
            return
        conn.server.flush()

    async def _idle_loop(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            now = time.monotonic()
            for conn in list(self._conns):
                silent = not conn.spoke and now - conn.opened > min(SILENT_TIMEOUT_S,
                                                                    self.idle_timeout)
                if silent or now - conn.last_active > self.idle_timeout:
                    conn.close()
                    self.idle_closed_total += 1

    async def stop_accepting(self) -> None:
        """No new connections (the socket goes); the piped ones go on."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def close(self, linger: float = 0.0) -> None:
        """Stop accepting, close each piped connection gracefully (what gRPC has written
        still reaches its client), and after `linger` seconds close what remains."""
        await self.stop_accepting()
        for conn in list(self._conns):
            conn.finish()
        deadline = time.monotonic() + linger
        while self._conns and time.monotonic() < deadline:
            await asyncio.sleep(LINGER_POLL_S)
        for conn in list(self._conns):
            conn.close()
