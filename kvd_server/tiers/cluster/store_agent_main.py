"""The store agent's program: the cluster store's client in a process of its own (see
kvd_server/tiers/cluster/store_agent.py for why and for the wire).

Started by the daemon as `python -m kvd_server.tiers.cluster.store_agent_main --fd N --factory
module:callable --config JSON`: it builds the store (`callable(config)`), answers READY (or
the error), then serves the daemon's calls on `--threads` threads until the daemon closes it
or goes away (end of file on its socket, or its parent changes), when it exits.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import socket
import sys
import threading
import time
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


def load_factory(spec: str) -> Callable[[dict], Store]:
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"--factory {spec!r}: expected module:callable")
    return getattr(importlib.import_module(module), attr)


class Agent:
    """Serves one daemon's calls on a store."""

    def __init__(self, sock: socket.socket, store: Store, threads: int) -> None:
        self.sock = sock
        self.store = store
        self._send_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="kvd-agent")

    def answer(self, ident: int, status: Status, aux: int = 0, value: bytes = b"") -> None:
        with self._send_lock:
            send_frame(self.sock, ident, status, aux, value=value)

    def _run(self, ident: int, op: int, name: str, value: bytearray) -> None:
        status, aux, out = Status.OK, 0, b""
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
            else:
                status, out = Status.ERROR, f"unknown op {op}".encode()
        except StoreError as exc:
            status, aux, out = Status.ERROR, exc.code, str(exc).encode()[:4096]
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
            status, out = Status.ERROR, f"{type(exc).__name__}: {exc}".encode()[:4096]
        with contextlib.suppress(OSError):                # the daemon is gone
            self.answer(ident, status, aux, out)

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
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    sock = socket.socket(fileno=args.fd)
    try:
        store: Any = load_factory(args.factory)(json.loads(args.config))
    except Exception as exc:  # noqa: BLE001 - told to the daemon, which degrades the tier
        code = exc.code if isinstance(exc, StoreError) else 0
        send_frame(sock, READY_ID, Status.ERROR, code, value=str(exc).encode()[:4096])
        return 2
    send_frame(sock, READY_ID, Status.OK)
    agent = Agent(sock, store, args.threads)
    code = agent.serve()
    if code:                               # the daemon is gone: leave the store if it is quick
        closer = threading.Thread(target=agent._close_store, daemon=True)
        closer.start()
        closer.join(CLOSE_WAIT_S)
    os._exit(code)     # the store's client threads must not keep the process


if __name__ == "__main__":
    sys.exit(main())
