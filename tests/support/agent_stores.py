"""Stores for the store agent's tests (kvd_server/tiers/cluster/store_agent.py), built in the agent's
process from a JSON config, each with a fault to show: a set-up that holds the GIL (as
Mooncake's does against a master that is down), a set-up that fails or never ends, a call that
never returns, a client that crashes the process, a failure whose cause only the client's log
says (as Mooncake's glog lines do)."""

from __future__ import annotations

import ctypes
import os
import threading
import time

from kvd_server.tiers.cluster.store import StoreError


def log_natively(line: str) -> None:
    """`line` on fd 2 as a native client's logger writes it (past Python's sys.stderr)."""
    os.write(2, (line + "\n").encode())


class MemoryStore:
    """A dict behind the Store calls; names starting with `hang` never answer, `crash` kills
    the process as a native client's fault would, `fail` raise, `logfail` log the cause as a
    glog error line first and raise with a bare code (Mooncake's way)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, bytes] = {}
        self.closed = False

    def _fault(self, name: str) -> None:
        if name.startswith("hang"):
            time.sleep(3600)
        if name.startswith("crash"):
            ctypes.string_at(0)             # a native client's fault: SIGSEGV, now
        if name.startswith("fail"):
            raise StoreError(f"refused {name}", -704)
        if name.startswith("logfail"):
            log_natively("E1129 00:55:40.000001  5208 transfer_task.cpp:77] Failed to open "
                         f"segment for {name}: connection reset by peer")
            raise StoreError(f"put {name}: code -800", -800)

    def put(self, name: str, value: bytes) -> None:
        self._fault(name)
        with self._lock:
            self._values[name] = bytes(value)

    def get(self, name: str) -> bytes | None:
        self._fault(name)
        with self._lock:
            return self._values.get(name)

    def exists(self, names: list[str]) -> list[bool]:
        for name in names:
            self._fault(name)
        with self._lock:
            return [n in self._values for n in names]

    def remove_prefix(self, prefix: str) -> None:
        with self._lock:
            for name in [n for n in self._values if n.startswith(prefix)]:
                del self._values[name]

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True


def memory(config: dict) -> MemoryStore:
    """config: hold_gil_s (set-up holds the GIL that long), log (lines the set-up writes to
    fd 2 first, as a native client's log), fail (set-up raises StoreError with that message),
    hang (set-up never ends)."""
    for line in config.get("log", ()):
        log_natively(line)
    if config.get("hold_gil_s"):
        # PyDLL keeps the GIL across the call, as a binding that does not release it does.
        ctypes.PyDLL(None).usleep(int(config["hold_gil_s"] * 1e6))
    if config.get("fail"):
        raise StoreError(config["fail"], -1)
    if config.get("hang"):
        time.sleep(3600)
    return MemoryStore()
