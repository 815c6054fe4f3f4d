"""Fuzz what tests/fault/test_fuzz.py does not: the attach side channel, RegisterSession and
SessionStream, the admin service, and hostile completions and fast-path binds (StoreGranted,
Pin) against another session's state.
Everything runs against ONE long-lived daemon (module scope), as a daemon lives in production.

For every case: the answer is OK or a documented status code (never UNKNOWN, INTERNAL or
DEADLINE_EXCEEDED: every call returns within its deadline), a refused request leaves the stats
document's blocks, pool and session accounting unchanged, and the daemon keeps answering health.

Case counts: `KVD_SOAK_FUZZ` (default 1000, `make soak` sets 10000) is shared out: 25% attach,
15% register/stream, 30% hostile completions (test_fuzz.py runs the other 30% on Step/unary).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd_client.attach import attach as client_attach
from kvd_proto import kvd_pb2, kvd_pb2_grpc
from tests.support.daemon import EXTENT, POOL, Daemon, spawn_daemon, target
from tests.support.engine import TOKEN, Engine, attach
from tests.support.summary import record
from tests.support.waits import wait_until

pytestmark = [pytest.mark.fault, pytest.mark.multiproc]
TOTAL = int(os.environ.get("KVD_SOAK_FUZZ", "1000"))
ATTACH_CASES = max(20, TOTAL * 25 // 100)
REGISTER_CASES = max(20, TOTAL * 15 // 100)
HOSTILE_CASES = max(20, TOTAL * 30 // 100)
CALL_TIMEOUT = 2.0
SLACK = 1.0
ATTACH_WAIT = 2.0 + SLACK         # the daemon drops a silent attach peer after 2 s
ATTACH_CODES = {"INVALID_ARGUMENT", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}
GRPC_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED,
              grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.RESOURCE_EXHAUSTED}


def fuzz(cases: int) -> settings:
    return settings(max_examples=cases, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    """One daemon for the whole module (1 s liveness, so fuzzed sessions are reaped fast)."""
    workdir = Path(tempfile.mkdtemp(prefix="kvd-fz-", dir="/tmp"))
    d = spawn_daemon(workdir, "--pool-size", POOL, "--extent-size", EXTENT)
    try:
        yield d
    finally:
        record("daemon crashes", int(d.proc.poll() is not None))
        d.close()
        log = d.log()
        shutil.rmtree(workdir, ignore_errors=True)
    assert "Traceback" not in log, log[-3000:]


def accounting(d: Daemon) -> tuple:
    """What a refused request must not change."""
    doc = d.stats()
    return (json.dumps(doc["blocks"], sort_keys=True),
            json.dumps({k: v for k, v in doc["pool"].items()
                        if k in ("used_bytes", "free_bytes", "extents_free")}, sort_keys=True),
            doc["stats"]["pins"], doc["stats"]["leases"], doc["clients"]["attached_total"],
            # an earlier case's empty namespace may be forgotten at a sweep meanwhile
            len(doc["namespaces"]) + doc["index_memory"]["namespaces_forgotten_total"])


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, grpc.StatusCode]:
    """Run a gRPC call; (response or None, status code). Fails if it overran its deadline."""
    t0 = time.monotonic()
    try:
        out, code = fn(*args, timeout=CALL_TIMEOUT, **kwargs), grpc.StatusCode.OK
    except grpc.RpcError as err:
        out, code = None, err.code()
        assert code in GRPC_CODES, f"undocumented status {code}: {err.details()}"
    took = time.monotonic() - t0
    assert took < CALL_TIMEOUT + SLACK, f"call took {took:.2f}s"
    return out, code


# --- attach side channel ------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=False), st.text(max_size=20), st.just([]), st.just({}))
attach_docs = st.fixed_dictionaries(
    {},
    optional={
        "version": st.one_of(st.just(1), st.sampled_from([0, 2, -1, "1", 1.0, True]), scalars),
        "pid": st.one_of(st.integers(0, 2**31), scalars),
        "engine_id": st.one_of(st.text(max_size=300), scalars),
        "role": st.one_of(st.sampled_from(["engine", "dataplane", "", "admin", "ENGINE"]),
                          scalars),
        "extra": scalars,
    })


def _line(doc: Any) -> bytes:
    return json.dumps(doc).encode() + b"\n"


payloads = st.one_of(
    attach_docs.map(_line),                                              # mutated requests
    st.just(_line({"version": 1, "pid": 1, "role": "engine"})),          # valid
    st.just(_line({"version": 1, "pid": 1, "role": "dataplane"})),
    st.just(_line({"version": 1, "pid": 1, "role": "admin"})),
    st.binary(max_size=600),                                             # garbage, no newline
    st.binary(max_size=600).map(lambda b: b + b"\n"),                    # garbage line
    st.sampled_from([b"[]\n", b"1\n", b"null\n", b'"x"\n', b"\n", b"   \n", b"\xff\xfe\n",
                     b'{"version": 1}\n{"version": 1}\n', b'{"version":1,"pid":1e999}\n']),
    st.integers(4097, 20000).map(lambda n: b'{"version": 1, "x": "' + b"a" * n + b'"}\n'),
    st.integers(4000, 9000).map(lambda n: b"z" * n),                     # oversized, no newline
)


def attach_raw(path: str, payload: bytes, half_close: bool) -> tuple[dict | None, list[int]]:
    """Send `payload` on the attach socket; the decoded reply (None if the daemon closed
    without one) and any descriptors received (the caller closes them)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(ATTACH_WAIT)
    fds: list[int] = []
    try:
        sock.connect(path)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(payload)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        buf = b""
        deadline = time.monotonic() + ATTACH_WAIT
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "the attach socket held a connection past its 2 s bound"
            sock.settimeout(remaining)
            try:
                data, got, _, _ = socket.recv_fds(sock, 65536, 4)
            except ConnectionResetError:
                data, got = b"", []
            fds += got
            if not data:
                break
            buf += data
        if not buf:
            return None, fds
        (length,) = struct.unpack(">I", buf[:4])
        assert length == len(buf) - 4 and length <= 65536, "malformed attach reply framing"
        return json.loads(buf[4:]), fds
    finally:
        sock.close()


def test_fuzz_attach_socket(daemon):
    path = daemon.socket + ".attach"
    started = time.monotonic()
    ran: list[int] = []

    @fuzz(ATTACH_CASES)
    @given(payload=payloads, half_close=st.booleans())
    def case(payload: bytes, half_close: bool) -> None:
        if b"\n" not in payload and not half_close:
            half_close = True                 # a silent peer is its own test below
        ran.append(1)
        record("fuzz cases")
        before = accounting(daemon)
        reply, fds = attach_raw(path, payload, half_close)
        try:
            if reply is None or not reply.get("ok"):
                assert not fds, "a refused attach passed a descriptor"
                if reply is not None:
                    assert reply.get("code") in ATTACH_CODES, reply
                    assert reply.get("error"), reply
                assert accounting(daemon) == before, "a refused attach changed the daemon"
            elif "admin_token" in reply:      # role admin (the tests run as root or the
                assert not fds, reply         # daemon's user): a token, never the pool
                assert len(reply["admin_token"]) == 64, reply
            else:
                assert len(fds) == 1 and reply["pool_bytes"] > 0, reply
                if reply.get("token"):        # an engine session: reaped after the liveness
                    with grpc.insecure_channel(target(daemon.socket)) as ch:
                        timed(kvd_pb2_grpc.KvdEngineStub(ch).CloseSession,
                              kvd_pb2.CloseSessionRequest(),
                              metadata=((TOKEN, reply["token"]),))
        finally:
            for fd in fds:
                os.close(fd)

    case()
    assert len(ran) >= ATTACH_CASES * 9 // 10, f"only {len(ran)} cases ran"
    assert daemon.serving()
    wait_until(lambda: daemon.stats()["sessions"] == 0, 5, "fuzzed attach sessions to end")
    assert time.monotonic() - started < 120 + ATTACH_CASES * 0.5


def test_silent_and_partial_attach_peers_are_dropped_and_do_not_block_others(daemon):
    path = daemon.socket + ".attach"
    silent = []
    try:
        for i in range(40):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            if i % 2:
                s.sendall(b'{"version": 1, "pid"')        # a partial line, then nothing
            silent.append(s)
        t0 = time.monotonic()
        info = attach(daemon.socket)                     # a real engine is not held up
        os.close(info.fd)
        assert time.monotonic() - t0 < 1.0
        for s in silent:                                  # every silent peer is dropped
            s.settimeout(ATTACH_WAIT + 1)
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(100) == b""
        assert time.monotonic() - t0 < ATTACH_WAIT + 1
    finally:
        for s in silent:
            s.close()
    assert daemon.serving()


def test_many_silent_attach_peers_do_not_starve_a_real_attach(daemon):
    path = daemon.socket + ".attach"
    silent = []
    try:
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            silent.append(s)
        time.sleep(0.2)
        # KvdClient attaches with a timeout of max(deadline, 1 s)
        info = client_attach(daemon.socket, role="engine", timeout=1.0)
        os.close(info.fd)
    finally:
        for s in silent:
            s.close()
    wait_until(daemon.serving, 10, "the daemon to serve again")


# --- RegisterSession and SessionStream ----------------------------------------------------

texts = st.one_of(st.text(max_size=40), st.text(min_size=250, max_size=300))
sizes = st.one_of(st.sampled_from([0, 1, 4096, 65536, 1 << 30, (1 << 30) + 1, 2**64 - 1]),
                  st.integers(0, 2**64 - 1), st.integers(1, 1 << 20))
ranks = st.one_of(st.sampled_from([0, 1, 2, 8, 1024, 1025]), st.integers(0, 2**32 - 1))


@st.composite
def registrations(draw: Any) -> kvd_pb2.RegisterSessionRequest:
    n = draw(ranks)
    shard = draw(sizes)
    consistent = draw(st.booleans())
    block = n * shard if consistent and n * shard < 2**64 else draw(sizes)
    return kvd_pb2.RegisterSessionRequest(
        engine=kvd_pb2.EngineIdentity(engine_id=draw(texts), engine_kind=draw(texts),
                                      engine_version=draw(texts), hostname=draw(texts),
                                      pid=draw(st.integers(0, 2**32 - 1))),
        model=draw(st.one_of(st.just("fuzz-reg-model"), texts)),
        layout=kvd_pb2.KvLayout(block_bytes=block, num_ranks=n, shard_bytes=shard,
                                tokens_per_block=draw(st.integers(0, 2**32 - 1)),
                                dtype=draw(texts)),
        layout_salt=draw(texts))


def test_fuzz_register_session_and_stream(daemon):
    pool_bytes = daemon.stats()["pool"]["total_bytes"]
    ran: list[int] = []
    with grpc.insecure_channel(target(daemon.socket)) as ch:
        stub = kvd_pb2_grpc.KvdEngineStub(ch)

        @fuzz(REGISTER_CASES)
        @given(req=registrations(), again=st.one_of(st.none(), registrations()),
               beats=st.lists(st.integers(0, 2**64 - 1), max_size=4))
        def case(req, again, beats) -> None:
            ran.append(1)
            record("fuzz cases")
            info = attach(daemon.socket)
            os.close(info.fd)
            md = ((TOKEN, info.token),)
            before = accounting(daemon)
            reg, code = timed(stub.RegisterSession, req, metadata=md)
            try:
                if code != grpc.StatusCode.OK:
                    assert code in (grpc.StatusCode.INVALID_ARGUMENT,
                                    grpc.StatusCode.RESOURCE_EXHAUSTED), code
                    assert accounting(daemon) == before, "a refused register changed the daemon"
                    return
                assert reg.slot_bytes >= req.layout.block_bytes and reg.slot_bytes % 4096 == 0
                assert reg.pool_bytes == pool_bytes and len(reg.namespace_id) == 32
                if again is not None:         # same namespace: a no-op; another: refused
                    reg2, code2 = timed(stub.RegisterSession, again, metadata=md)
                    if code2 == grpc.StatusCode.OK:
                        assert reg2.namespace_id == reg.namespace_id
                    else:
                        assert code2 in (grpc.StatusCode.INVALID_ARGUMENT,
                                         grpc.StatusCode.FAILED_PRECONDITION), code2
                if beats:                     # a stream that ends ends the session
                    notices = list(stub.SessionStream(
                        iter([kvd_pb2.SessionHeartbeat(seq=s) for s in beats]), metadata=md,
                        timeout=CALL_TIMEOUT))
                    assert [n.seq for n in notices] == beats
                    assert all(n.state == kvd_pb2.DAEMON_STATE_SERVING for n in notices)
                    _, gone = timed(stub.Lookup, kvd_pb2.LookupRequest(keys=[b"k"]),
                                    metadata=md)
                    assert gone == grpc.StatusCode.UNAUTHENTICATED
            finally:
                timed(stub.CloseSession, kvd_pb2.CloseSessionRequest(), metadata=md)

        case()
        assert len(ran) >= REGISTER_CASES * 9 // 10, f"only {len(ran)} cases ran"
        # a stream with a missing or unknown token is refused, not served
        for md in ((), ((TOKEN, "0" * 64),), ((TOKEN, "x"),)):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.SessionStream(iter([kvd_pb2.SessionHeartbeat(seq=1)]), metadata=md,
                                        timeout=CALL_TIMEOUT))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert daemon.serving()
    wait_until(lambda: daemon.stats()["sessions"] == 0, 5, "fuzzed sessions to end")


# --- hostile completions, wrong epochs and offsets, admin misuse ----------------------------


@pytest.fixture
def owner(daemon) -> Iterator[tuple[Engine, kvd_pb2.PrepareStoreResponse, list[bytes]]]:
    """An engine holding a pin on a ready block and a pending store: the fuzzer's target."""
    eng = Engine(daemon.socket, "fuzz-owner-model", block=4096, engine_id="owner")
    ready = [b"r1", b"r2", b"r3", b"r4"]
    eng.store(ready)
    eng.call("PrepareLoad", kvd_pb2.PrepareLoadRequest(keys=ready[:1]))
    pending = eng.store([b"p1", b"p2"], complete=False)
    try:
        yield eng, pending, ready
    finally:
        eng.close()


def test_fuzz_hostile_completions_wrong_epochs_offsets_and_admin_misuse(daemon, owner):
    eng, pending, ready = owner
    epoch = pending.epoch
    pool_bytes = eng.pool_bytes
    attacker = Engine(daemon.socket, "fuzz-owner-model", block=4096, engine_id="attacker")
    other_ns = Engine(daemon.socket, "fuzz-other-model", block=4096, engine_id="other")
    closed = Engine(daemon.socket, "fuzz-owner-model", block=4096, engine_id="closed")
    closed.close()
    admin = daemon.admin()
    storing = list(pending.keys_to_store)
    owned = storing + ready
    keys = st.lists(st.one_of(st.sampled_from(owned), st.binary(min_size=1, max_size=8)),
                    max_size=6, unique=True)
    epochs = st.one_of(st.sampled_from([0, epoch, epoch + 1, 2**63, 2**64 - 1]),
                       st.integers(0, 2**64 - 1))
    offsets = st.one_of(
        st.sampled_from([0, pool_bytes, pool_bytes - 1, pool_bytes + 4096, 4095, 2**64 - 1]),
        st.sampled_from(list(pending.slot_offsets)),
        st.integers(0, 2**64 - 1), st.integers(0, pool_bytes // 4096).map(lambda x: x * 4096))
    who = st.sampled_from(["attacker", "other_ns", "closed", "garbage", "none"])

    @st.composite
    def calls(draw: Any) -> tuple[str, str, Any]:
        kind = draw(st.sampled_from(["complete_store", "complete_load", "step", "admin"]))
        ks = draw(keys)
        if kind == "complete_store":
            offs = draw(st.one_of(st.just([]), st.lists(offsets, min_size=len(ks),
                                                        max_size=len(ks)),
                                  st.lists(offsets, max_size=3)))
            return kind, draw(who), kvd_pb2.CompleteStoreRequest(
                keys=ks, success=draw(st.booleans()), epoch=draw(epochs), slot_offsets=offs,
                req_id=draw(st.text(max_size=5)))
        if kind == "complete_load":
            return kind, draw(who), kvd_pb2.CompleteLoadRequest(keys=ks, epoch=draw(epochs))
        if kind == "step":
            ops = draw(st.lists(st.one_of(
                st.builds(lambda e, o: kvd_pb2.StepOp(complete_store=kvd_pb2.CompleteStoreRequest(
                    keys=ks, success=True, epoch=e, slot_offsets=o)), epochs,
                    st.lists(offsets, min_size=len(ks), max_size=len(ks))),
                st.builds(lambda e: kvd_pb2.StepOp(complete_load=kvd_pb2.CompleteLoadRequest(
                    keys=ks, epoch=e)), epochs),
                st.just(kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(keys=ks))),
                st.just(kvd_pb2.StepOp(touch=kvd_pb2.TouchRequest(keys=ks))),
                # The fast path's binds, forged: no slot was granted to the caller, so
                # nothing binds; and a Pin of blocks still being stored pins nothing (any
                # session of the namespace may pin a ready one, so that is not fuzzed here).
                st.builds(lambda o: kvd_pb2.StepOp(store_granted=kvd_pb2.StoreGrantedRequest(
                    keys=ks, granted_keys=ks, granted_offsets=o)),
                    st.lists(offsets, min_size=len(ks), max_size=len(ks))),
                st.builds(lambda o: kvd_pb2.StepOp(pin=kvd_pb2.PinRequest(
                    keys=storing, slot_offsets=o)),
                    st.lists(offsets, min_size=len(storing), max_size=len(storing)))),
                max_size=4))
            return kind, draw(who), kvd_pb2.StepRequest(ops=ops)
        req = draw(st.one_of(
            st.builds(lambda n: ("Reset", kvd_pb2.AdminResetRequest(namespace_id=n)),
                      st.text(min_size=1, max_size=300)),
            st.builds(lambda n: ("ListSessions", kvd_pb2.ListSessionsRequest(limit=n)),
                      st.integers(0, 2**32 - 1)),
            st.just(("Stats", kvd_pb2.StatsRequest())),
            st.just(("GetConfig", kvd_pb2.GetConfigRequest()))))
        return kind, draw(st.sampled_from(["admin", "attacker"])), req

    ran: list[int] = []
    md_of = {"attacker": attacker.md, "other_ns": other_ns.md, "closed": closed.md,
             "garbage": ((TOKEN, "g" * 64),), "none": ()}

    @fuzz(HOSTILE_CASES)
    @given(call=calls())
    def case(call) -> None:
        ran.append(1)
        record("fuzz cases")
        kind, as_, req = call
        before = accounting(daemon)
        if kind == "admin":
            method, request = req
            md = daemon.admin_md() if as_ == "admin" else attacker.md  # tokens expire
            _, code = timed(getattr(admin, method), request, metadata=md)
            if as_ != "admin":
                assert code == grpc.StatusCode.PERMISSION_DENIED, code
            elif method == "Reset":
                # never the empty id (that would reset every namespace): unknown or too long
                assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
            elif method == "ListSessions" and request.limit > 10000:
                assert code == grpc.StatusCode.INVALID_ARGUMENT
            else:
                assert code == grpc.StatusCode.OK
        else:
            method = {"complete_store": "CompleteStore", "complete_load": "CompleteLoad",
                      "step": "Step"}[kind]
            out, code = timed(getattr(attacker.stub, method), req, metadata=md_of[as_])
            if as_ in ("closed", "garbage", "none"):
                assert code == grpc.StatusCode.UNAUTHENTICATED, code
            if code == grpc.StatusCode.OK and kind == "complete_store":
                assert out.completed == 0, "another session's pending store was completed"
        # Whatever the answer, nobody but the owner can touch the owner's pin or store.
        assert accounting(daemon) == before, f"{kind} as {as_} changed the daemon: {req}"

    case()
    assert len(ran) >= HOSTILE_CASES * 9 // 10, f"only {len(ran)} cases ran"
    rows = [s for s in daemon.admin().ListSessions(kvd_pb2.ListSessionsRequest(),
                                                   timeout=5).sessions
            if s.engine.engine_id == "owner" or s.peer_pid == os.getpid() and s.pins]
    assert len(rows) == 1, f"the owner's session is gone: {daemon.log()[-3000:]}"
    (row,) = rows
    assert (row.pins, row.pending_stores) == (1, 2)
    # The owner's own state still completes exactly.
    done = eng.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
        keys=list(pending.keys_to_store), success=True, epoch=epoch,
        slot_offsets=list(pending.slot_offsets)))
    assert done.completed == 2
    eng.call("CompleteLoad", kvd_pb2.CompleteLoadRequest(keys=ready[:1], epoch=epoch))
    doc = daemon.stats()
    assert doc["stats"]["pins"] == 0 and doc["blocks"]["storing"] == 0
    attacker.close()
    other_ns.close()
    assert daemon.serving()
