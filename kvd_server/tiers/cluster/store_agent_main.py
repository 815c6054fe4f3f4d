"""The store agent's program: the cluster store's client in a process of its own (see
kvd_server/tiers/cluster/store_agent.py for why and for the wire).

Started by the daemon as `python -m kvd_server.tiers.cluster.store_agent_main --fd N --factory
module:callable --config JSON`: it builds the store (`callable(config)`), answers READY (or
the error), then serves the daemon's calls on `--threads` threads until the daemon closes it
or goes away (end of file on its socket, or its parent changes), when it exits.

A failure says what the store's client said. Mooncake's client answers a failed call with a
bare code (-1 for a set-up that cannot find a LAN address, or whose metadata server or RDMA
device is missing) and puts the cause in its log (glog lines on stderr, `E1129 00:55:33.47
5208 transfer_engine_impl.cpp:166] not valid LAN address found`), among hundreds of others.
So the agent's stderr goes through a pipe it reads (`ErrorLog`), passed on unchanged to the
daemon's, and the error lines logged while a call ran are named in its failure: the first
(the cause; the rest mostly follow from it), how many, and the last.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import re
import select
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvd_server.tiers.cluster.store import Store, StoreError
from kvd_server.tiers.cluster.store_agent import (
    READY_ID,
    Op,
    Status,
    WireError,
    recv_frame,
    send_frame,
)

log = logging.getLogger("kvd_server.tiers.cluster.store_agent")
ORPHAN_CHECK_S = 1.0
CLOSE_WAIT_S = 4.0
MAX_LINE = 200              # characters of one logged error named in a failure
KEPT_LINES = 256            # the latest error lines remembered, and as many of the first
# glog's line: severity (E error, F fatal), date, time, thread, file:line] message.
GLOG_ERROR = re.compile(r"^[EF]\d{4} [\d:.]+\s+\d+ ([^\]]+)\] (.*)$")


class ErrorLog:
    """This process's stderr (fd 2, where the store's native client logs) through a pipe: every
    byte passed on to the stderr it had (the daemon's), and the client's error lines kept,
    numbered, so a failure can name the ones logged since it began (see the module doc).

    The pipe is read under `_io`, by a thread while bytes come and by `settle` (a failure
    about to be answered): what a call wrote to fd 2 before it returned is then parsed, never
    left in a reader's hands."""

    def __init__(self) -> None:
        self._out = os.dup(2)                      # where the bytes go on: the daemon's stderr
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._in = read_fd
        self._io = threading.Lock()                # held while the pipe is read and parsed
        self._lock = threading.Lock()
        # The first error lines (a failed set-up's cause comes first, however many follow)
        # and the latest (a failed call's, later on), numbered.
        self._first: list[tuple[int, str, str]] = []
        self._lines: deque[tuple[int, str, str]] = deque(maxlen=KEPT_LINES)
        self._count = 0                           # error lines seen so far
        self._rest = b""                          # a line read without its end yet
        threading.Thread(target=self._pump, name="kvd-agent-log", daemon=True).start()

    def _pump(self) -> None:
        while True:
            try:
                select.select([self._in], [], [])
            except OSError:
                return
            with self._io:
                if not self._drain():
                    return

    def _drain(self) -> bool:
        """Under `_io`: pass on and parse what the pipe holds now; False once it is closed."""
        while True:
            try:
                chunk = os.read(self._in, 1 << 16)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not chunk:
                return False
            view = memoryview(chunk)
            while view:
                try:
                    view = view[os.write(self._out, view):]
                except OSError:                   # the daemon's stderr is gone: keep reading
                    break
            *lines, rest = (self._rest + chunk).split(b"\n")
            self._rest = rest[-4096:]             # a line without an end, bounded
            with self._lock:
                for line in lines:
                    m = GLOG_ERROR.match(line.decode(errors="replace").strip())
                    if m:
                        self._count += 1
                        entry = (self._count, m.group(1), m.group(2).strip())
                        if len(self._first) < KEPT_LINES:
                            self._first.append(entry)
                        else:
                            self._lines.append(entry)

    @property
    def mark(self) -> int:
        """Where the log is now: `since(mark)` names what is logged from here on."""
        self.settle()
        with self._lock:
            return self._count

    def settle(self) -> None:
        """Everything written to fd 2 so far is passed on and parsed when this returns."""
        with self._io:
            self._drain()

    def since(self, mark: int) -> str:
        """The error lines logged after `mark`, in one bounded phrase ("" when none): the first
        with where it was logged, how many, and the last when it differs."""
        self.settle()
        with self._lock:
            lines = [e for e in (*self._first, *self._lines) if e[0] > mark]
            count = self._count - mark
        if not lines:
            return ""

        def said(where: str, text: str) -> str:
            cut = text if len(text) <= MAX_LINE else text[:MAX_LINE - 3] + "..."
            return f"{cut} [{where}]"

        first = said(*lines[0][1:])
        if count == 1:
            return f"its client logged: {first}"
        which = "first" if lines[0][0] == mark + 1 else "earliest kept"
        last = said(*lines[-1][1:])
        tail = f"; last: {last}" if last != first else ""
        return f"its client logged: {first} ({which} of {count} error lines{tail})"


def _with_log(message: str, logged: str) -> str:
    """A failure's message and what the client logged meanwhile, within a frame's bound."""
    return f"{message}; {logged}" if logged else message


def load_factory(spec: str) -> Callable[[dict], Store]:
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"--factory {spec!r}: expected module:callable")
    return getattr(importlib.import_module(module), attr)


class Agent:
    """Serves one daemon's calls on a store."""

    def __init__(self, sock: socket.socket, store: Store, threads: int,
                 errors: ErrorLog | None = None) -> None:
        self.sock = sock
        self.store = store
        self.errors = errors
        self._send_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="kvd-agent")

    def answer(self, ident: int, status: Status, aux: int = 0, value: bytes = b"") -> None:
        with self._send_lock:
            send_frame(self.sock, ident, status, aux, value=value)

    def _run(self, ident: int, op: int, name: str, value: bytearray) -> None:
        status, aux, out = Status.OK, 0, b""
        mark = self.errors.mark if self.errors is not None else 0
        try:
            if op == Op.PUT:
                self.store.put(name, value)     # a Buffer: Mooncake's upsert takes one
            elif op == Op.GET:
                got = self.store.get(name)
                status, out = (Status.NONE, b"") if got is None else (Status.OK, got)
            elif op == Op.REMOVE_PREFIX:
                self.store.remove_prefix(name)
            elif op == Op.HEALTHY:
                out = b"\x01" if self.store.healthy() else b"\x00"
            elif op == Op.EXISTS:
                names = bytes(value).decode().split("\n") if value else []
                out = bytes(map(int, self.store.exists(names)))
            else:
                status, out = Status.ERROR, f"unknown op {op}".encode()
        except StoreError as exc:
            status, aux, out = Status.ERROR, exc.code, self._failure(str(exc), mark)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
            status, out = Status.ERROR, self._failure(f"{type(exc).__name__}: {exc}", mark)
        with contextlib.suppress(OSError):                # the daemon is gone
            self.answer(ident, status, aux, out)

    def _failure(self, message: str, mark: int) -> bytes:
        """A failed call's answer: its message and what the client logged while it ran (other
        calls' lines among them when they failed at once: the same store's trouble)."""
        logged = self.errors.since(mark) if self.errors is not None else ""
        return _with_log(message, logged).encode()[:4096]

    def serve(self) -> int:
        """Until CLOSE (0) or the daemon goes away (1)."""
        while True:
            try:
                frame = recv_frame(self.sock, request=True)
            except (OSError, WireError) as exc:
                log.error("store agent: the daemon's end broke (%s): exiting", exc)
                return 1
            if frame is None:
                return 1
            ident, op, _, name, value = frame
            if op == Op.CLOSE:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._close_store()
                with contextlib.suppress(OSError):
                    self.answer(ident, Status.OK)
                return 0
            self._pool.submit(self._run, ident, op, name.decode(errors="replace"), value)

    def _close_store(self) -> None:
        try:
            self.store.close()
        except Exception:
            log.exception("store agent: closing the store's client")


def _exit_when_orphaned(parent: int) -> None:
    """The daemon died (SIGKILL) while this process is busy: go too."""
    while True:
        time.sleep(ORPHAN_CHECK_S)
        if os.getppid() != parent:
            os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvd-store-agent", description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="the daemon's socket")
    parser.add_argument("--factory", required=True, help="module:callable building the store")
    parser.add_argument("--config", default="{}", help="the store's configuration (JSON)")
    parser.add_argument("--threads", type=int, default=8, help="calls served at once")
    args = parser.parse_args(argv)
    errors = ErrorLog()          # before the store's client writes its first line
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    sock = socket.socket(fileno=args.fd)
    try:
        store: Any = load_factory(args.factory)(json.loads(args.config))
    except Exception as exc:  # noqa: BLE001 - told to the daemon, which degrades the tier
        code = exc.code if isinstance(exc, StoreError) else 0
        message = _with_log(str(exc), errors.since(0))
        send_frame(sock, READY_ID, Status.ERROR, code, value=message.encode()[:4096])
        errors.settle()          # its lines reach the daemon's log before the agent exits
        return 2
    send_frame(sock, READY_ID, Status.OK)
    agent = Agent(sock, store, args.threads, errors)
    code = agent.serve()
    if code:                               # the daemon is gone: leave the store if it is quick
        closer = threading.Thread(target=agent._close_store, daemon=True)
        closer.start()
        closer.join(CLOSE_WAIT_S)
    os._exit(code)     # the store's client threads must not keep the process


if __name__ == "__main__":
    sys.exit(main())
