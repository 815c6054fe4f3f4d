"""An engine on the fast path (OffloadSession over KvdClient) for the multi-process and fault
tests: helpers a test process drives its own engine with, and, run as a module, an engine in a
separate process that a test drives command by command (so it can be stopped or killed at an
exact point: after a pin, before its copy).

Protocol of the engine process: `python -m tests.support.offload_engine SOCKET MODEL
RESERVE`; it prints one JSON line once connected, then answers each JSON command read from
stdin with one JSON line (see `EngineProcess` for the commands).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvd_client.client import KvdClient
from kvd_client.offload.session import Lookup, OffloadSession
from kvd_proto import kvd_pb2
from kvd_proto.wire import KvLayout
from tests.support.daemon import PY, ROOT, clean_env
from tests.support.engine import BLOCK, Engine, block_bytes_of, keys_for
from tests.support.processes import readline_within
from tests.support.waits import wait_until

LAYOUT = KvLayout(BLOCK, 1, BLOCK, 16, "bfloat16")
SETTLE_S = 20.0           # bound on waiting for the daemon's answers (a loaded 2-core machine)


# --- an engine in this process ---------------------------------------------------------------


def open_session(socket: str, model: str, *, reserve: int = 16, deadline_s: float = 0.5,
                 connect_timeout: float = 10.0, keep_evicted: bool = True,
                 answers: tuple[Any, ...] | None = None) -> OffloadSession:
    """An engine's OffloadSession, connected (its first step adopts the index).
    `keep_evicted` False: blocks evicted into its reserve are misses (a test of what a tier
    below serves counts only those). `answers`: the session's (miss, hit, pending[, retry])."""
    client = KvdClient(socket, model=model, layout=LAYOUT, deadline_s=deadline_s,
                       engine_id=f"test-{os.getpid()}", engine_kind="pytest")
    session = OffloadSession(client, reserve=reserve, keep_evicted=keep_evicted,
                             **({"answers": answers} if answers else {}))
    if not client.wait_available(connect_timeout):
        close_session(session)
        raise AssertionError(f"engine did not connect to {socket} in {connect_timeout}s")
    return session


def close_session(session: OffloadSession) -> None:
    session.close()
    session.client.close()


def count_blocking_calls(client: KvdClient) -> list[int]:
    """Calls to the daemon made on this (the scheduler's) thread from now on, as
    bench/control_plane.py counts them: [n], updated in place."""
    main = threading.get_ident()
    count = [0]
    for name in ("step", "flush"):
        fn = getattr(client, name)

        def wrapped(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            if threading.get_ident() == main:
                count[0] += 1
            return _fn(*args, **kwargs)

        setattr(client, name, wrapped)
    return count


def settle(session: OffloadSession, timeout: float = SETTLE_S) -> None:
    """End the step and keep stepping until the daemon answered everything sent."""
    session.end_step()
    deadline = time.monotonic() + timeout
    while session.has_pending_work():
        if time.monotonic() > deadline:
            raise AssertionError(f"the daemon did not answer an engine's messages in {timeout}s")
        time.sleep(0.005)
        session.end_step()


def write_block(session: OffloadSession, offset: int, key: bytes) -> None:
    pool = session.client.pool
    assert pool is not None, "no pool mapping"
    view = pool.view(offset, BLOCK)
    try:
        view[:] = block_bytes_of(key)
    finally:
        view.release()


def read_block(pool: Any, offset: int) -> bytes:
    view = pool.view(offset, BLOCK)
    try:
        return bytes(view)
    finally:
        view.release()


def store(session: OffloadSession, keys: Sequence[bytes], *, timeout: float = SETTLE_S,
          stall_s: float | None = None, wait: bool = True, req_id: str = ""
          ) -> list[tuple[bytes, int]] | None:
    """Store `keys` as an engine does: reserve slots, write each block's bytes, complete, end
    the step (and, with `wait`, step until the daemon answered). The (key, offset) pairs
    granted; None when the reserve stayed short for `stall_s` seconds (None: fail after
    `timeout`)."""
    keys = list(keys)
    started = time.monotonic()
    while True:
        granted = session.reserve(keys, req_id)
        if granted is not None:
            break
        session.end_step()                  # asks for more grants in the background
        waited = time.monotonic() - started
        if stall_s is not None and waited > stall_s:
            return None
        if waited > timeout:
            raise AssertionError(f"the reserve stayed short of {len(keys)} slots for {timeout}s")
        time.sleep(0.01)
    for key, offset in granted:
        write_block(session, offset, key)
    session.complete_store([key for key, _ in granted], req_id)
    if wait:
        settle(session, timeout)
    else:
        session.end_step()
    return granted


def load(session: OffloadSession, keys: Sequence[bytes], req_id: str = ""
         ) -> tuple[list[Lookup], list[bytes]]:
    """Look `keys` up in one step, load the HITs (pin, copy, unpin): (states, keys whose bytes
    were not their own)."""
    states = [session.lookup(key) for key in keys]
    hits = [key for key, state in zip(keys, states) if state is Lookup.HIT]
    pool = session.client.pool
    offsets = session.start_loads(hits, req_id)
    assert None not in offsets, "a HIT of this step could not be pinned"
    bad = [key for key, offset in zip(hits, offsets)
           if read_block(pool, offset) != block_bytes_of(key)]
    session.finish_loads(hits, req_id)
    session.end_step()
    return states, bad


def read_back(session: OffloadSession, keys: Sequence[bytes], batch: int = 32,
              timeout: float = SETTLE_S) -> tuple[int, int]:
    """Read `keys` back as a scheduler does, `batch` at a time (HIT_PENDING: ask again next
    step; HIT: pin, copy, check, unpin; MISS: give up): (blocks loaded, keys that read MISS).
    Fails on a wrong byte and on a batch whose promotions do not end within `timeout`."""
    loaded = missed = 0
    pool = session.client.pool
    for i in range(0, len(keys), batch):
        pending = list(keys[i:i + batch])
        deadline = time.monotonic() + timeout
        while pending:
            assert time.monotonic() < deadline, \
                f"{len(pending)} promotions did not end in {timeout}s"
            states = [session.lookup(k) for k in pending]
            hits = [k for k, s in zip(pending, states, strict=True) if s is Lookup.HIT]
            if hits:
                offsets = session.start_loads(hits)
                wrong = [k for k, o in zip(hits, offsets, strict=True)
                         if o is None or read_block(pool, o) != block_bytes_of(k)]
                session.finish_loads(hits)
                assert not wrong, f"{len(wrong)} blocks served with bytes not their own"
                loaded += len(hits)
            missed += sum(s is Lookup.MISS for s in states)
            pending = [k for k, s in zip(pending, states, strict=True)
                       if s is Lookup.HIT_PENDING]
            session.end_step()
            if pending:
                time.sleep(0.002)
        settle(session)
    return loaded, missed


# --- what the daemon says --------------------------------------------------------------------


def namespace(doc: dict[str, Any], model: str) -> dict[str, Any]:
    return next(ns for ns in doc["namespaces"] if ns["model"] == model)


def wait_idle(daemon: Any, timeout: float = SETTLE_S) -> dict[str, Any]:
    """Wait until no session is left and nothing is held, pinned or being stored; the stats."""

    def idle() -> dict[str, Any] | None:
        doc = daemon.stats()
        pool, blocks = doc["pool"], doc["blocks"]
        if doc["sessions"] or pool["quarantined_slots"] or pool["quarantined_pins"] \
                or blocks["pinned"] or blocks["storing"] or blocks["zombie"]:
            return None
        return doc

    return wait_until(idle, timeout, "every session to end and nothing to stay held")


def assert_no_slot_leaked(daemon: Any, model: str) -> None:
    """With no session left, a store of as many new keys as the whole pool holds must be
    granted, each in its own slot (by evicting every block): a slot leaked by a session, a
    grant or limbo would make it `cannot_store` or short."""
    doc = wait_idle(daemon)
    pool = doc["pool"]
    assert pool["free_bytes"] + pool["used_bytes"] == pool["total_bytes"], pool
    probe = Engine(daemon.socket, model, engine_id="leak-probe")
    try:
        # Read with the probe's session open: an empty namespace is forgotten once its last
        # session has gone (after the readers' grace), and the probe's brings it back.
        slot_bytes = namespace(daemon.stats(), model)["slot_bytes"]
        capacity = pool["extents_total"] * (pool["extent_bytes"] // slot_bytes)
        keys = keys_for("whole-pool-probe", capacity)
        grant = probe.call("PrepareStore", kvd_pb2.PrepareStoreRequest(keys=keys, req_id="p"))
        assert not grant.cannot_store, "a slot is still held though every session ended"
        assert len(grant.keys_to_store) == capacity, (len(grant.keys_to_store), capacity)
        assert len(set(grant.slot_offsets)) == capacity, "one slot handed out twice"
        probe.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
            keys=list(grant.keys_to_store), success=False, req_id="p", epoch=grant.epoch))
    finally:
        probe.close()


# --- an engine in another process ------------------------------------------------------------


class EngineProcess:
    """An engine process driven by commands: `lookup`, `pin`, `read`, `unpin`, `end_step`,
    `settle`, `reserve` (and write), `complete`, `store`, `load`, `counts` (the lookups it
    answered), `native` (whether its loops are compiled), `close` (see `_serve`)."""

    def __init__(self, socket: str, model: str, reserve: int = 4, native: bool = True) -> None:
        """`native` False: the process runs the Python twins of kvd's compiled loops
        (KVD_NATIVE=0); True: whatever this test run uses."""
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in kill()
        env = clean_env() if native else clean_env(KVD_NATIVE="0")
        self.proc = subprocess.Popen(
            [PY, "-m", "tests.support.offload_engine", socket, model, str(reserve)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, text=True, cwd=ROOT)
        try:
            self.hello = json.loads(readline_within(self.proc, 30, self._stderr))
        except BaseException:
            self.kill()
            raise
        self.pid = self.proc.pid

    def ask(self, op: str, keys: Sequence[bytes] = (), timeout: float = 30.0,
            **fields: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "keys": [k.hex() for k in keys],
                                          **fields}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(readline_within(self.proc, timeout, self._stderr))
        if "error" in answer:
            raise AssertionError(f"engine process failed on {op}: {answer['error']}")
        return answer

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def close(self) -> None:
        """Close its session and let it exit (killed if it does not)."""
        if self.proc.poll() is None:
            try:
                self.ask("close")
                self.proc.wait(15)
            finally:
                self.kill()
        self.kill()

    def kill(self) -> None:
        """SIGKILL (a stopped process dies too) and reap; never leaves a child behind."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.wait(15)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._stderr.close()


def reading_engine(daemon: Any, writer: OffloadSession, model: str, seed: str, *,
                   reported: bool, stopped: bool) -> tuple[EngineProcess, list[bytes], set[int]]:
    """An engine process that looked up 4 HITs (stored by `writer`) and pinned them without
    copying yet, so its published epoch holds freed slots back: (process, its keys, their
    offsets). `reported`: its step ended and the daemon read the PIN (the blocks are pinned
    there too); `stopped`: it is then stopped (SIGSTOP) and reaped by the daemon for silence,
    so an ended session whose process lives on holds."""
    ready = keys_for(seed, 8)
    assert store(writer, ready) is not None
    reader = EngineProcess(daemon.socket, model)
    try:
        assert reader.ask("lookup", ready[:4])["states"] == ["hit"] * 4
        offsets = set(reader.ask("pin", ready[:4])["offsets"])
        assert len(offsets) == 4
        if reported:
            reader.ask("end_step")
            reader.ask("settle")
            assert daemon.stats()["blocks"]["pinned"] == 4
        if stopped:
            reaped = daemon.stats()["clients"]["reaped_total"]
            reader.stop()
            wait_until(lambda: daemon.stats()["clients"]["reaped_total"] > reaped, 10,
                       "the stopped engine's session to be reaped")
    except BaseException:
        reader.kill()
        raise
    return reader, ready[:4], offsets


def _serve(socket: str, model: str, reserve: int) -> int:
    session = open_session(socket, model, reserve=reserve)
    pinned: dict[bytes, tuple[Any, int]] = {}     # key -> (the mapping it was pinned in, offset)
    reserved: list[bytes] = []
    print(json.dumps({"pid": os.getpid(), "session": session.client.session_id}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        keys = [bytes.fromhex(k) for k in cmd.get("keys", [])]
        try:
            if op == "lookup":
                answer: dict[str, Any] = {"states": [session.lookup(k).value for k in keys]}
            elif op == "pin":
                pool = session.client.pool
                offsets = session.start_loads(keys)
                for key, offset in zip(keys, offsets):
                    if offset is not None:
                        pinned[key] = (pool, offset)
                answer = {"offsets": offsets}
            elif op == "read":
                answer = {"match": [read_block(*pinned[k]) == block_bytes_of(k) for k in keys]}
            elif op == "unpin":
                session.finish_loads(keys)
                for key in keys:
                    pinned.pop(key, None)
                answer = {}
            elif op == "end_step":
                session.end_step()
                answer = {}
            elif op == "settle":
                settle(session)
                answer = {}
            elif op == "reserve":
                granted = session.reserve(keys)
                for key, offset in granted or ():
                    write_block(session, offset, key)
                reserved = [key for key, _ in granted or ()]
                answer = {"granted": None if granted is None
                          else [[k.hex(), o] for k, o in granted]}
            elif op == "complete":
                session.complete_store(keys or reserved)
                answer = {}
            elif op == "store":
                granted = store(session, keys)
                answer = {"granted": [[k.hex(), o] for k, o in granted or ()]}
            elif op == "load":
                states, bad = load(session, keys)
                answer = {"states": [s.value for s in states], "bad": [k.hex() for k in bad]}
            elif op == "native":
                from kvd_proto.native import NATIVE
                answer = {"native": NATIVE}
            elif op == "counts":
                answer = {"lookups": session.lookups_total, "hits": session.hits_total,
                          "misses": session.misses_total}
            elif op == "close":
                close_session(session)
                print(json.dumps({}), flush=True)
                return 0
            else:
                answer = {"error": f"unknown command {op!r}"}
        except Exception as exc:  # noqa: BLE001 - the test reads what went wrong
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    close_session(session)
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1], sys.argv[2], int(sys.argv[3])))
