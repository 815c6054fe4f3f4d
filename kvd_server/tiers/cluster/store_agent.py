"""The cluster store's client in a child process of its own: the store agent.

Mooncake's Python client holds the GIL in some of its blocking calls: `setup` against a master
that is down held it for 90 s on this project's CI machine, `close` for ~3 s (measured: a
ticker thread stalled as long). In the daemon's process that froze everything, the event loop
and the engines' heartbeats included, whenever the master went away. So the client lives in
a child process (`python -m kvd_server.tiers.cluster.store_agent_main`) and the daemon talks to it
over a socket pair: whatever the client holds, hangs on or crashes with costs the daemon
nothing but a failed call (the tier degrades and, after its retry interval, starts a new
agent).

The wire is the daemon's own, not an API: fixed frames, one request and one answer per id,
answers in any order (the agent runs calls on several threads, as the tier's threads make
them). A frame is `FRAME` (id, op or status, aux, value length) then aux bytes of name
(requests) and the value; an error's aux is the store's code and its value the message.
Every call has a deadline; an agent that misses one is killed, as is one that breaks the wire.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from enum import IntEnum

from kvd_server.tiers.cluster.store import StoreError, StoreUnavailable

log = logging.getLogger(__name__)

FRAME = struct.Struct("<IBxxxiI")     # id, op/status, aux (name length / error code), length
MAX_NAME = 4096
MAX_VALUE = 256 << 20                  # a block, a manifest (1 Mi keys) or the node list
READY_ID = 0                           # the agent's first answer: its store is set up
CONNECT_WAIT_S = 30.0                  # set-up (Mooncake's against a live master: ~0.05 s)
CALL_WAIT_S = 45.0                     # Mooncake gives up on a hung master after 30 s
CLOSE_WAIT_S = 5.0                     # then the agent is killed
SOCKET_BUFFER = 4 << 20


class Op(IntEnum):
    PUT = 1
    GET = 2
    REMOVE_PREFIX = 3
    HEALTHY = 4
    CLOSE = 5
    EXISTS = 6        # value: names, one per line; answer: one byte (0/1) per name


class Status(IntEnum):
    OK = 0
    NONE = 1          # get: the store does not hold the name
    ERROR = 2         # aux: the store's code; value: the message


class WireError(Exception):
    """A frame that is not one (the other side is broken)."""


def send_frame(sock: socket.socket, ident: int, op: int, aux: int = 0, name: bytes = b"",
               value: bytes = b"") -> None:
    """One frame (a request names its object: aux is then the name's length)."""
    head = FRAME.pack(ident, op, len(name) if name else aux, len(value))
    sock.sendall(head + name)
    if value:
        sock.sendall(value)


def recv_exact(sock: socket.socket, n: int, *, first: bool = False) -> bytearray | None:
    """n bytes; None at end of file before the first byte of a frame (`first`), else an end
    of file is a WireError."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0 and first:
                return None
            raise WireError(f"end of file inside a frame ({got} of {n} bytes)")
        got += k
    return buf


def recv_frame(sock: socket.socket, *, request: bool) -> tuple[int, int, int, bytes, bytearray
                                                               ] | None:
    """(id, op/status, aux, name, value), or None at end of file; bounds checked."""
    head = recv_exact(sock, FRAME.size, first=True)
    if head is None:
        return None
    ident, op, aux, length = FRAME.unpack(head)
    if length > MAX_VALUE:
        raise WireError(f"a frame of {length} bytes (at most {MAX_VALUE})")
    name = b""
    if request:
        if not 0 <= aux <= MAX_NAME:
            raise WireError(f"a name of {aux} bytes (at most {MAX_NAME})")
        name = bytes(recv_exact(sock, aux) or b"")
    return ident, op, aux, name, recv_exact(sock, length) or bytearray()


@dataclass(slots=True)
class _Call:
    done: threading.Event
    status: int = -1
    aux: int = 0
    value: bytearray | None = None


class AgentStore:
    """The Store the cluster tier uses: each call goes to the agent and waits for its answer
    (off the event loop: on the tier's threads, with the GIL released while it waits)."""

    def __init__(self, factory: str, config: dict, *, threads: int = 8,
                 connect_wait_s: float = CONNECT_WAIT_S, call_wait_s: float = CALL_WAIT_S
                 ) -> None:
        """Start an agent whose store is `factory(config)` ("module:callable"); returns once
        it is set up. StoreUnavailable when it fails to or does not within connect_wait_s."""
        self.call_wait_s = call_wait_s
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (ours, theirs):          # a 2 MiB block in few wake-ups of either side
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        args = [sys.executable, "-m", "kvd_server.tiers.cluster.store_agent_main", "--fd",
                str(theirs.fileno()), "--factory", factory, "--threads", str(threads),
                "--config", json.dumps(config)]
        try:
            self._proc = subprocess.Popen(args, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                          close_fds=True)
        except OSError as exc:
            ours.close()
            raise StoreUnavailable(f"the store agent cannot start: {exc}") from exc
        finally:
            theirs.close()
        self._sock = ours
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._next_id = READY_ID + 1
        self._dead: str | None = None
        self._closing = False             # close() has begun: the agent's exit is expected
        try:
            self._await_ready(connect_wait_s)
        except BaseException:
            self._kill()
            self._sock.close()
            raise
        log.info("cluster store agent (pid %d) set up", self._proc.pid)
        self._reader = threading.Thread(target=self._read, name="kvd-store-agent", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _await_ready(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreUnavailable(f"the store's client did not set up in {wait_s:.0f}s: "
                                       "killed (its lines in the daemon's log say what it "
                                       "waited for)")
            readable, _, _ = select.select([self._sock], [], [], min(left, 0.5))
            if readable:
                break
            if self._proc.poll() is not None:
                raise StoreUnavailable(f"the store agent exited (code {self._proc.returncode}) "
                                       "before its client was set up: see the daemon's log")
        try:
            frame = recv_frame(self._sock, request=False)
        except (OSError, WireError) as exc:
            raise StoreUnavailable(f"the store agent broke off: {exc}") from exc
        if frame is None:
            code = self._proc.wait(timeout=CLOSE_WAIT_S)
            raise StoreUnavailable(f"the store agent exited (code {code}) before its client "
                                   "was set up: see the daemon's log")
        _, status, aux, _, value = frame
        if status != Status.OK:
            raise StoreUnavailable(value.decode(errors="replace"), aux)

    # ------------------------------------------------------------------ calls
    def _call(self, op: Op, name: str = "", value: bytes = b"", wait_s: float | None = None
              ) -> tuple[int, int, bytearray]:
        wait_s = self.call_wait_s if wait_s is None else wait_s
        call = _Call(threading.Event())
        with self._lock:
            if self._dead is not None:
                raise StoreError(self._dead)
            ident = self._next_id
            self._next_id = ident % 0xFFFFFFFF + 1
            self._calls[ident] = call
        try:
            with self._send_lock:
                send_frame(self._sock, ident, op, name=name.encode(), value=value)
        except OSError as exc:
            self._fail(f"the store agent is gone ({exc})")
        if not call.done.wait(wait_s):
            self._fail(f"the store agent did not answer in {wait_s:.0f}s: killed")
        with self._lock:
            self._calls.pop(ident, None)
        if call.status == Status.ERROR:
            raise StoreError((call.value or b"").decode(errors="replace"), call.aux)
        if call.status < 0:
            raise StoreError(self._dead or "the store agent is gone")
        return call.status, call.aux, call.value or bytearray()

    def put(self, name: str, value: bytes) -> None:
        self._call(Op.PUT, name, value)

    def get(self, name: str) -> bytearray | None:
        status, _, value = self._call(Op.GET, name)
        return None if status == Status.NONE else value

    def exists(self, names: list[str]) -> list[bool]:
        value = "\n".join(names).encode()
        if len(value) > MAX_VALUE:
            raise StoreError(f"{len(names)} names are more than one call carries")
        answer = self._call(Op.EXISTS, value=value)[2]
        if len(answer) != len(names):
            raise StoreError(f"the store agent answered {len(answer)} of {len(names)} names")
        return [b == 1 for b in answer]

    def remove_prefix(self, prefix: str) -> None:
        self._call(Op.REMOVE_PREFIX, prefix)

    def healthy(self) -> bool:
        try:
            return self._call(Op.HEALTHY)[2] == b"\x01"
        except StoreError:
            return False

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Let the client leave the store (Mooncake tells its master), then end the agent;
        killed after wait_s."""
        with self._lock:
            alive = self._dead is None
            self._closing = True
        if alive:
            try:
                self._call(Op.CLOSE, wait_s=wait_s)
            except StoreError as exc:
                log.warning("cluster store agent: closing its client: %s", exc)
        self._fail("the store's client is closed", quiet=True)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=wait_s)
        self._kill()

    # ------------------------------------------------------------------ agent
    def _read(self) -> None:
        """The answers, as they come, to their callers; at the end every caller still waiting
        fails (the agent died or broke the wire)."""
        why = "the store agent closed its end"
        try:
            while True:
                frame = recv_frame(self._sock, request=False)
                if frame is None:
                    break
                ident, status, aux, _, value = frame
                with self._lock:
                    call = self._calls.get(ident)
                if call is None:
                    continue                    # an answer after its caller gave up
                call.status, call.aux, call.value = status, aux, value
                call.done.set()
        except (OSError, WireError) as exc:
            why = f"the store agent broke the wire ({exc})"
        if self._closing:       # it left because close() asked it to (an answer raced it)
            self._fail("the store's client is closed", quiet=True)
        try:                    # an agent that died: its code tells why (a signal: a crash)
            code: int | None = self._proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        self._fail(why if code is None else f"the store agent exited (code {code})")
        self._sock.close()

    def _fail(self, why: str, quiet: bool = False) -> None:
        """The agent is of no more use: every waiting caller fails with `why` (logged unless
        `quiet`); it is killed."""
        with self._lock:
            first = self._dead is None
            if first:
                self._dead = why
            calls = list(self._calls.values())
        for call in calls:
            call.done.set()
        if first and not quiet:
            log.warning("cluster store agent (pid %d): %s", self._proc.pid, why)
            self._kill()

    def _kill(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGKILL)
            try:
                self._proc.wait(timeout=CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                log.error("cluster store agent (pid %d) did not die", self._proc.pid)
        with contextlib.suppress(OSError):  # wakes the reader (end of file), which closes it
            self._sock.shutdown(socket.SHUT_RDWR)
