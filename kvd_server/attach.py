"""The attach side channel: hands the pool's fd and a session token to a verified local peer.

Protocol (docs/attach.md): the client sends one JSON line (<= 4096 bytes); the daemon reads the
peer's credentials from the kernel (SO_PEERCRED: nothing the client says is trusted for
identity), asks the handler for a reply, and answers with a 4-byte big-endian length and a JSON
body; on success the pool's fd rides with it (SCM_RIGHTS). One exchange per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_REQUEST_BYTES = 4096
REQUEST_TIMEOUT_S = 2.0
MAX_WAITING = 256     # connections still owing their request line; the oldest goes first
ROLES = ("engine", "dataplane", "admin")


@dataclass(slots=True, frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


@dataclass(slots=True, frozen=True)
class AttachRequest:
    version: int
    pid: int
    engine_id: str
    role: str


@dataclass(slots=True)
class AttachReply:
    """Success: fields for the JSON answer plus the fd to pass. `fields` must be JSON-able."""

    fields: dict[str, Any] = field(default_factory=dict)
    fd: int = -1


class AttachRefused(Exception):
    """Raised by a handler to refuse an attach with a code (PERMISSION_DENIED, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def peer_credentials(sock: socket.socket) -> PeerCred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)


def parse_request(line: bytes) -> AttachRequest:
    try:
        doc = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AttachRefused("INVALID_ARGUMENT", f"attach request is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise AttachRefused("INVALID_ARGUMENT", "attach request must be a JSON object")
    version = doc.get("version")
    if version != PROTOCOL_VERSION:
        raise AttachRefused("INVALID_ARGUMENT",
                            f"unsupported attach protocol version {version!r}; "
                            f"this daemon speaks {PROTOCOL_VERSION}")
    pid = doc.get("pid", 0)
    engine_id = doc.get("engine_id", "")
    role = doc.get("role", "engine")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0:
        raise AttachRefused("INVALID_ARGUMENT", "pid must be a non-negative integer")
    if not isinstance(engine_id, str) or len(engine_id.encode()) > 256:
        raise AttachRefused("INVALID_ARGUMENT", "engine_id must be a string of at most 256 bytes")
    if role not in ROLES:
        raise AttachRefused("INVALID_ARGUMENT", f"role must be one of {', '.join(ROLES)}")
    return AttachRequest(version, pid, engine_id, role)


def encode_reply(doc: dict[str, Any]) -> bytes:
    body = json.dumps(doc, separators=(",", ":")).encode()
    return struct.pack(">I", len(body)) + body


Handler = Callable[[PeerCred, AttachRequest], AttachReply]


class AttachServer:
    """asyncio server of the attach socket. The handler runs on the event loop."""

    def __init__(self, path: str, mode: int, handler: Handler) -> None:
        self.path = path
        self.mode = mode
        self.handler = handler
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        # Insertion-ordered: when too many peers sit silent, the one silent longest is dropped,
        # so silent or slow peers can never keep a real engine from attaching.
        self._waiting: dict[asyncio.Task[None], None] = {}
        self.attaches_total = 0
        self.refusals_total = 0

    async def start(self) -> None:
        remove_stale_socket(self.path)
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
        line = buf.split(b"\n", 1)[0]
        self._waiting.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
        try:
            if len(line) > MAX_REQUEST_BYTES or (b"\n" not in buf and len(buf) > MAX_REQUEST_BYTES):
                raise AttachRefused("INVALID_ARGUMENT",
                                    f"attach request longer than {MAX_REQUEST_BYTES} bytes")
            if not line.strip():
                raise AttachRefused("INVALID_ARGUMENT", "empty attach request")
            request = parse_request(line)
            reply = self.handler(peer, request)
        except AttachRefused as refusal:
            self.refusals_total += 1
            log.info("attach refused for pid %d uid %d: %s", peer.pid, peer.uid, refusal.message)
            await loop.sock_sendall(conn, encode_reply({
                "version": PROTOCOL_VERSION, "ok": False,
                "code": refusal.code, "error": refusal.message}))
            return
        payload = encode_reply({"version": PROTOCOL_VERSION, "ok": True, **reply.fields})
        # The fd rides with the first bytes; the (small) rest follows with plain sends.
        sent = await _send_with_fd(loop, conn, payload, reply.fd)
        if sent < len(payload):
            await loop.sock_sendall(conn, payload[sent:])
        self.attaches_total += 1

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


async def _send_with_fd(loop: asyncio.AbstractEventLoop, conn: socket.socket, payload: bytes,
                        fd: int) -> int:
    fds = [fd] if fd >= 0 else []
    for _ in range(200):  # a fresh socket's buffer takes this at once; bounded retries otherwise
        try:
            return socket.send_fds(conn, [payload], fds)
        except BlockingIOError:
            await asyncio.sleep(0.01)
    raise TimeoutError("attach peer does not read")


def remove_stale_socket(path: str) -> None:
    """Remove a socket file left by a dead daemon; refuse if a live one still answers."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # nobody listens: stale
        return
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise OSError(f"another kvd daemon is serving on {path}")
