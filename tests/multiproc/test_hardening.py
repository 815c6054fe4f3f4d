"""Hardening against a real daemon: bounded resources, the wire contract exactly as the proto
states it, identities that cannot collide, pools shared fairly, and start-up that respects the
machine and its signals. Each test names the promise it checks (docs/reliability.md)."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from kvd_proto import kvd_pb2
from tests.support.daemon import PY, ROOT, clean_env, spawn_daemon
from tests.support.engine import Engine, block_bytes_of, keys_for
from tests.support.summary import record
from tests.support.waits import wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.fault]
# `make soak` makes the long versions: seconds of lease renewals, silent connections opened.
SOAK_S = float(os.environ.get("KVD_SOAK_HARDEN_S", "3"))
SOAK_CONNECTIONS = int(os.environ.get("KVD_SOAK_CONNECTIONS", "400"))


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


# --- identities ----------------------------------------------------------------------------


def test_identity_strings_with_control_characters_are_refused(daemon):
    e = Engine(daemon.socket, register=False)
    try:
        for field in ("model", "layout_salt"):
            req = kvd_pb2.RegisterSessionRequest(
                model="m\x00x", layout=kvd_pb2.KvLayout(block_bytes=4096, num_ranks=1,
                                                        shard_bytes=4096))
            if field == "layout_salt":
                req.model, req.layout_salt = "m", "a\x00b"
            assert code_of(lambda r=req: e.call("RegisterSession", r)) == \
                grpc.StatusCode.INVALID_ARGUMENT
        bad = kvd_pb2.RegisterSessionRequest(model="m", layout=kvd_pb2.KvLayout(
            block_bytes=4096, num_ranks=1, shard_bytes=4096, dtype="bf\n16"))
        assert code_of(lambda: e.call("RegisterSession", bad)) == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        e.close()


def test_different_layouts_never_share_a_namespace(daemon):
    """A 4 KiB and an 8 KiB layout whose strings joined with NUL used to collide."""
    small = Engine(daemon.socket, model="m", block=4096)
    big = Engine(daemon.socket, model="m", block=8192)
    try:
        assert small.reg.namespace_id != big.reg.namespace_id
        assert (small.reg.slot_bytes, big.reg.slot_bytes) == (4096, 8192)
        small.store(keys_for("ns", 4))
        assert set(big.lookup(keys_for("ns", 4)).states) == {kvd_pb2.BLOCK_STATE_MISS}
    finally:
        small.close()
        big.close()


# --- fair share of a full pool --------------------------------------------------------------


def test_a_second_model_gets_room_in_a_pool_the_first_filled(daemon):
    first = Engine(daemon.socket, model="first")
    keys = keys_for("first", 1024)                   # 64 MiB of 64 KiB blocks: the whole pool
    for i in range(0, len(keys), 256):
        first.store(keys[i:i + 256])
    first.close()                                    # its engine exits; its blocks stay
    second = Engine(daemon.socket, model="second")
    try:
        grant = second.store(keys_for("second", 256))
        assert not grant.cannot_store and len(grant.keys_to_store) == 256
        ns = {n["model"]: n for n in daemon.stats()["namespaces"]}
        assert ns["second"]["extents"] == 4 and ns["first"]["extents"] == 12
        assert ns["first"]["evictions_total"] == 256
        data = second.load(keys_for("second", 256)[:8])
        assert data == [block_bytes_of(k) for k in keys_for("second", 256)[:8]]
    finally:
        second.close()


# --- bounded resources ----------------------------------------------------------------------


def test_renewing_the_same_leases_does_not_grow_the_daemon(daemon):
    e = Engine(daemon.socket)
    keys = keys_for("renew", 512)
    try:
        e.store(keys)
        for _ in range(20):                           # warm up the allocator
            e.lookup(keys, lease_ms=30_000)
        before = rss_anon(daemon.proc.pid)
        end = time.monotonic() + SOAK_S
        renewals = 0
        while time.monotonic() < end:
            e.lookup(keys, lease_ms=30_000)
            renewals += len(keys)
        grown = rss_anon(daemon.proc.pid) - before
        assert renewals > 20_000
        record("bound checks")
        # Memory follows the leases held (plus allocator slack that levels off within one
        # lease duration), not the renewals made: a heap entry per renewal took 515 MiB in 20 s.
        assert grown < 32 << 20, f"{renewals} renewals grew the daemon by {grown >> 20} MiB"
        assert daemon.stats()["stats"]["leases"] == len(keys)
    finally:
        e.close()


def test_offers_under_one_open_request_are_bounded(daemon):
    """A client offering endless new keys under one request it never finishes: the daemon's
    request bookkeeping stops growing (the offers are still answered)."""
    e = Engine(daemon.socket, block=4096)
    try:
        before = rss_anon(daemon.proc.pid)
        for i in range(60):
            keys = keys_for(f"offer-{i}", 4096)
            grant = e.call("PrepareStore", kvd_pb2.PrepareStoreRequest(
                keys=keys, req_id="forever", positions=list(range(4096))))
            if grant.keys_to_store:
                e.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
                    keys=grant.keys_to_store, success=False, req_id="forever",
                    epoch=grant.epoch))
        grown = rss_anon(daemon.proc.pid) - before
        record("bound checks")
        assert grown < 48 << 20, f"245,760 offers grew the daemon by {grown >> 20} MiB"
    finally:
        e.close()


def test_an_attach_flood_of_one_uid_leaves_room_for_the_others(start_daemon):
    daemon = start_daemon("--pool-size", "16MiB", "--extent-size", "4MiB",
                          env=clean_env(KVD_SERVER_MAX_SESSIONS_PER_UID="8",
                                        KVD_MANAGER_REGISTER_TIMEOUT="500ms",
                                        KVD_SERVER_MAX_SESSIONS="16"))
    from kvd_client.attach import AttachError, attach

    held = []
    refused = 0
    for _ in range(40):                               # one user floods
        try:
            held.append(attach(daemon.socket, timeout=2))
        except AttachError as exc:
            assert exc.code == "RESOURCE_EXHAUSTED"
            refused += 1
    record("bound checks")
    assert len(held) == 8 and refused == 32
    assert daemon.stats()["sessions"] == 8
    for info in held:
        os.close(info.fd)
    # Sessions that never register expire quickly, so the flood does not last either.
    wait_until(lambda: daemon.stats()["sessions"] == 0, 5, "unregistered sessions to expire")
    engine = Engine(daemon.socket)                    # and a real engine gets in
    engine.close()


# --- the wire contract, exactly ---------------------------------------------------------------


def test_take_events_answers_stay_under_the_message_limit(start_daemon):
    daemon = start_daemon("--pool-size", "256MiB", "--extent-size", "16MiB")
    e = Engine(daemon.socket, block=4096)
    try:
        key = lambda i: i.to_bytes(4, "big") * 29 + b"!!"   # noqa: E731 - 118-byte keys
        keys = [key(i) for i in range(36_000)]
        for i in range(0, len(keys), 4096):
            e.store(keys[i:i + 4096])                 # 9 stored events, 36,000 keys
            e.call("Reset", kvd_pb2.ResetRequest())   # ... and nothing evicted
        taken = 0
        for _ in range(100):
            out = e.call("TakeEvents", kvd_pb2.TakeEventsRequest(max_events=65536))
            assert out.ByteSize() < 4 << 20
            taken += sum(len(ev.keys) for ev in out.events if not ev.removed)
            if not out.more:
                break
        assert taken == len(keys)
    finally:
        e.close()


def test_a_request_over_the_message_limit_is_invalid_argument_in_band(daemon):
    e = Engine(daemon.socket)
    big = kvd_pb2.StepRequest(ops=[kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(
        keys=[os.urandom(128) for _ in range(4096)])) for _ in range(9)])
    assert big.ByteSize() > 4 << 20
    channel = grpc.insecure_channel(f"unix://{daemon.socket}", options=[
        ("grpc.max_send_message_length", 64 << 20)])
    try:
        from kvd_proto import kvd_pb2_grpc

        stub = kvd_pb2_grpc.KvdEngineStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Step(big, metadata=e.md, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "MAX_MESSAGE_BYTES" in err.value.details()
        small = kvd_pb2.StepRequest(ops=[kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(
            keys=[b"k"]))])
        answers = list(stub.StepStream(iter([big, small]), metadata=e.md, timeout=10))
        assert answers[0].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert answers[1].error_code == 0 and len(answers[1].results) == 1   # stream lives on
    finally:
        channel.close()
        e.close()


def test_close_session_is_idempotent_and_needs_a_token(daemon):
    e = Engine(daemon.socket)
    e.call("CloseSession", kvd_pb2.CloseSessionRequest())
    e.call("CloseSession", kvd_pb2.CloseSessionRequest())          # unknown token now: OK
    channel = grpc.insecure_channel(f"unix://{daemon.socket}")
    try:
        from kvd_proto import kvd_pb2_grpc

        stub = kvd_pb2_grpc.KvdEngineStub(channel)
        assert code_of(lambda: stub.CloseSession(kvd_pb2.CloseSessionRequest(), timeout=5)) \
            == grpc.StatusCode.UNAUTHENTICATED
    finally:
        channel.close()
        e.close()


def test_non_finite_transfer_reports_are_refused(daemon):
    """Transfer totals reach the daemon as a worker's report on the attach socket (role
    `report`): a time that is not a finite number >= 0 is refused, and nothing of it reaches
    the stats."""
    from kvd_proto.attach import ROLE_REPORT, AttachError, AttachRequest, TransferReport, exchange

    for value in (math.inf, math.nan, -1.0):
        request = AttachRequest(ROLE_REPORT, "w0", TransferReport(load_bytes=1, load_seconds=value))
        with pytest.raises(AttachError) as refused:
            exchange(daemon.socket, request, 5.0)
        assert refused.value.code == "INVALID_ARGUMENT" and "load_seconds" in refused.value.message
    out = daemon.kvd("stats", "--json")
    assert out.returncode == 0 and "Infinity" not in out.stdout and "NaN" not in out.stdout
    assert json.loads(out.stdout)["transfers"]["load_bytes_total"] == 0


def test_deeply_nested_json_on_the_attach_socket_is_refused_without_a_traceback(daemon):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(daemon.socket + ".attach")
        s.sendall(b"[" * 4000 + b"\n")
        n = struct.unpack(">I", s.recv(4))[0]
        doc = json.loads(s.recv(n))
    assert doc["ok"] is False and doc["code"] == "INVALID_ARGUMENT"
    assert "Traceback" not in daemon.log() and "RecursionError" not in daemon.log()


# --- start-up ---------------------------------------------------------------------------------


def test_a_pool_larger_than_the_machine_is_refused_with_both_numbers(workdir: Path):
    proc = subprocess.run([PY, "-m", "kvd_server", "serve", "--socket", str(workdir / "k.sock"),
                           "--pool-size", "64TiB"], env=clean_env(), capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1
    assert "MemAvailable" in proc.stderr and "--allow-overcommit" in proc.stderr, proc.stderr


def test_overcommit_is_allowed_when_asked(workdir: Path):
    with open("/proc/meminfo") as f:
        avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable"))
    daemon = spawn_daemon(workdir, "--pool-size", str(2 * avail), "--allow-overcommit",
                          env=clean_env(KVD_POOL_PREFAULT="false"))
    try:
        assert daemon.stats()["pool"]["total_bytes"] >= 2 * avail
    finally:
        daemon.close()


def test_sigterm_during_prefault_stops_within_a_second_and_extends_systemds_timeout(
        workdir: Path):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_path = str(workdir / "notify")
    notify.bind(notify_path)
    notify.settimeout(20)
    env = clean_env(NOTIFY_SOCKET=notify_path)
    proc = subprocess.Popen([PY, "-m", "kvd_server", "serve", "--socket",
                             str(workdir / "k.sock"), "--pool-size", "8GiB"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        messages = []
        while not any("EXTEND_TIMEOUT_USEC=" in m for m in messages):
            messages.append(notify.recv(4096).decode())
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        took = time.monotonic() - t0
        out = proc.stdout.read().decode() if proc.stdout else ""
        assert took < 1.5, f"stopped {took:.1f}s after SIGTERM during the pre-fault\n{out}"
        assert "pre-fault stopped" in out and "kvd stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        notify.close()


# --- connections ------------------------------------------------------------------------------


def _silent_connections(path: str, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        out.append(s)
    return out


def _closed_by_peer(s: socket.socket, timeout: float = 2.0) -> bool:
    """Whether the daemon closes `s` within `timeout` (what it sent first is read past)."""
    end = time.monotonic() + timeout
    while True:
        s.settimeout(max(0.01, end - time.monotonic()))
        try:
            if s.recv(4096) == b"":
                return True
        except TimeoutError:
            return False
        except OSError:
            return True


def test_connections_per_uid_are_bounded_and_silent_ones_closed(start_daemon):
    daemon = start_daemon("--pool-size", "16MiB", env=clean_env(
        KVD_SERVER_MAX_CONNECTIONS_PER_UID="20", KVD_SERVER_IDLE_TIMEOUT="3s"))
    socks = _silent_connections(daemon.socket, 30)
    refused_by = time.monotonic() + 2.0
    try:
        # Closed within 2 s of connecting, it was not the 3 s idle timeout (a margin for a
        # loaded machine: at 0.8 s against 1 s, one of ten missed once in CI).
        refused = [s for s in socks[20:]
                   if _closed_by_peer(s, max(0.01, refused_by - time.monotonic()))]
        assert len(refused) == 10                     # past the uid's limit: closed at once
        for s in socks[:20]:                          # silent: closed within the idle timeout
            assert _closed_by_peer(s, 5.0)
        assert daemon.serving()                       # and the same uid gets in again
    finally:
        for s in socks:
            s.close()


def test_at_its_descriptor_limit_the_daemon_still_serves_health_and_attach(workdir: Path):
    import resource

    def few_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    env = clean_env(KVD_SERVER_MAX_CONNECTIONS_PER_UID="100000")
    sock_path = str(workdir / "k.sock")
    with open(workdir / "d.log", "wb") as log:
        proc = subprocess.Popen([PY, "-m", "kvd_server", "serve", "--socket", sock_path,
                                 "--pool-size", "16MiB"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=few_descriptors)
    socks: list[socket.socket] = []
    try:
        wait_until(lambda: subprocess.run([PY, "-m", "kvd_server", "health", "--socket",
                                           sock_path], env=env, capture_output=True,
                                          cwd=ROOT).returncode == 0, 30, "the daemon to serve")
        # More than the daemon has descriptors (19,000 in `make soak`, against the default
        # limit of this machine's user).
        socks = _silent_connections(sock_path, SOAK_CONNECTIONS)
        health = subprocess.run([PY, "-m", "kvd_server", "health", "--socket", sock_path,
                                 "--timeout", "5"], env=env, capture_output=True, text=True,
                                cwd=ROOT, timeout=30)
        assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr
        from kvd_client.attach import attach

        info = attach(sock_path, timeout=5)
        os.close(info.fd)
        record("bound checks")
        assert "Traceback" not in (workdir / "d.log").read_text()
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(20)
