"""The attach side channel's server: hands the pool's fd and a session token to a verified
local peer.

The wire format (one JSON line in, one length-prefixed JSON answer out, the fd via SCM_RIGHTS)
is `kvd_proto.attach`; this module serves it on an asyncio loop. The peer's identity comes
from the kernel (SO_PEERCRED), never from what it sends. A handler refuses with a KvdError
(its status name becomes the answer's `code`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvd_proto.attach import (
    MAX_REQUEST_BYTES,
    REQUEST_TIMEOUT_S,
    ROLE_REPORT,
    AttachError,
    AttachRequest,
    encode_refusal,
    encode_reply,
    parse_request,
)
from kvd_proto.paths import clear_stale_socket
from kvd_server.core.peer import PeerCred, peer_credentials
from kvd_server.errors import KvdError

log = logging.getLogger(__name__)

MAX_WAITING = 256     # connections still owing their request line; the oldest goes first
# What an attach's debug line shows of its answer (tokens never).
DEBUG_FIELDS = ("session_id", "tenant", "pool_bytes", "pool_id", "index_bytes",
                "channel_bytes", "up_bytes", "down_bytes", "expires_ms")


@dataclass(slots=True)
class AttachReply:
    """Success: fields for the JSON answer plus the descriptors to pass (the daemon keeps its
    own; the peer receives duplicates). `fields` must be JSON-able."""

    fields: dict[str, Any] = field(default_factory=dict)
    fd: int = -1
    more_fds: tuple[int, ...] = ()


Handler = Callable[[PeerCred, AttachRequest], AttachReply]


class AttachServer:
    """asyncio server of the attach socket. The handler runs on the event loop."""

    def __init__(self, path: str, mode: int, handler: Handler,
                 on_exhausted: Callable[[], bool] | None = None) -> None:
        self.path = path
        self.mode = mode
        self.handler = handler
        # Called when accept() finds no descriptor left: frees one (the front door sheds its
        # idlest connection) so attaches keep working at the limit.
        self.on_exhausted = on_exhausted
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        # Insertion-ordered: when too many peers sit silent, the one silent longest is dropped,
        # so silent or slow peers can never keep a real engine from attaching.
        self._waiting: dict[asyncio.Task[None], None] = {}
        self.refusals_total = 0          # requests refused (`kvd stats`: connections)

    async def start(self) -> None:
        clear_stale_socket(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.path)
            os.chmod(self.path, self.mode)
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._accept_loop(),
                                                            name="kvd-attach")

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except asyncio.CancelledError:
                raise
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self.on_exhausted is not None \
                        and self.on_exhausted():
                    continue
                log.warning("attach accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            if len(self._waiting) >= MAX_WAITING:
                oldest = next(iter(self._waiting))
                self._waiting.pop(oldest)
                oldest.cancel()
            task = loop.create_task(self._serve(conn))
            self._conns.add(task)
            self._waiting[task] = None
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._conns.discard(task)
        self._waiting.pop(task, None)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setblocking(False)
            await asyncio.wait_for(self._exchange(conn), REQUEST_TIMEOUT_S)
        except TimeoutError:
            log.debug("attach peer sent no complete request in %.0fs", REQUEST_TIMEOUT_S)
        except asyncio.CancelledError:
            log.debug("dropped a silent attach peer to make room")
        except OSError as exc:
            log.debug("attach connection failed: %s", exc)
        except Exception:  # the side channel must never take the daemon down
            log.exception("attach handler failed")
        finally:
            conn.close()

    async def _exchange(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        peer = peer_credentials(conn)
        buf = b""
        while b"\n" not in buf:
            chunk = await loop.sock_recv(conn, MAX_REQUEST_BYTES + 1 - len(buf))
            if not chunk:
                break
            buf += chunk
            if len(buf) > MAX_REQUEST_BYTES:
                break
        line = buf.split(b"\n", 1)[0] if b"\n" in buf else buf
        self._waiting.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
        try:
            request = parse_request(line)
            reply = self.handler(peer, request)
        except (AttachError, KvdError) as refusal:
            self.refusals_total += 1
            log.info("attach refused for pid %d uid %d: %s", peer.pid, peer.uid, refusal.message)
            await loop.sock_sendall(conn, encode_refusal(refusal.code, refusal.message))
            return
        payload = encode_reply(reply.fields)
        # The fd rides with the first bytes; the (small) rest follows with plain sends.
        fds = ([reply.fd] if reply.fd >= 0 else []) + list(reply.more_fds)
        sent = await _send_with_fds(loop, conn, payload, fds)
        if sent < len(payload):
            await loop.sock_sendall(conn, payload[sent:])
        if request.role != ROLE_REPORT and log.isEnabledFor(logging.DEBUG):
            log.debug("attach: pid %d uid %d gid %d as %s%s: %d descriptor(s), %s", peer.pid,
                      peer.uid, peer.gid, request.role,
                      f" (engine {request.engine_id})" if request.engine_id else "", len(fds),
                      _shown(reply.fields))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _shown(fields: dict[str, Any]) -> str:
    """An answer's fields for the debug log: the listed ones, never a token."""
    shown = [f"{name} {fields[name]}" for name in DEBUG_FIELDS if name in fields]
    return ", ".join(shown) or "no fields"


async def _send_with_fds(loop: asyncio.AbstractEventLoop, conn: socket.socket,
                         payload: bytes, fds: list[int]) -> int:
    for _ in range(200):  # a fresh socket's buffer takes this at once; bounded retries otherwise
        try:
            return socket.send_fds(conn, [payload], fds)
        except BlockingIOError:
            await asyncio.sleep(0.01)
    raise TimeoutError("attach peer does not read")
