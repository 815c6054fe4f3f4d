"""Engines sharing one daemon: bytes round-trip between processes, a killed client's slots and
pins come back, a reset with stores in flight never exposes a half-written block."""

from __future__ import annotations

import json
import signal

import pytest

from kvd_proto import kvd_pb2
from tests.support.client import run_client, start_client
from tests.support.daemon import Daemon
from tests.support.engine import block_bytes_of, keys_for
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc

HIT = kvd_pb2.BLOCK_STATE_HIT
MISS = kvd_pb2.BLOCK_STATE_MISS


def _json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_clients_share_bytes_through_the_pool(daemon: Daemon):
    stored = _json(run_client(daemon.socket, "store", "model-a", "shared", "8"))
    assert stored["stored"] == 8 and not stored["cannot_store"]
    loaded = _json(run_client(daemon.socket, "load", "model-a", "shared", "8"))
    assert loaded["states"] == [HIT] * 8
    assert loaded["match"] is True
    # Another model is another namespace: the same keys are not visible there.
    other = _json(run_client(daemon.socket, "load", "model-b", "shared", "8"))
    assert other["states"][0] == MISS

    doc = daemon.stats()
    assert doc["blocks"]["ready"] == 8
    assert doc["pool"]["free_bytes"] < doc["pool"]["total_bytes"]


def test_two_sessions_attached_at_once(daemon: Daemon, engines):
    a, b = engines(engine_id="a"), engines(engine_id="b")
    assert a.reg.namespace_id == b.reg.namespace_id
    keys = keys_for("live", 4)
    a.store(keys)
    assert list(b.lookup(keys).states) == [HIT] * 4
    assert b.load(keys) == [block_bytes_of(k) for k in keys]
    assert daemon.stats()["sessions"] == 2
    wait_until(lambda: a.notices, 5, "a heartbeat answer")
    assert a.notices[0].state == kvd_pb2.DAEMON_STATE_SERVING
    assert a.notices[0].epoch == a.reg.epoch and a.notices[0].seq == 1
    listed = daemon.kvd("sessions", "--json")
    assert listed.returncode == 0
    assert json.loads(listed.stdout)["total"] == 2


def test_killed_client_frees_pending_slots_and_pins(daemon: Daemon, engines):
    keys = keys_for("victim", 8)
    writer = engines()
    writer.store(keys[:4])  # ready blocks the victim will pin

    victim = start_client(daemon.socket, "hang", "test-model", "victim", "8")
    try:
        line = victim.stdout.readline()
        assert json.loads(line) == {"pinned": 4, "storing": 4}, victim.stderr.read()
        doc = daemon.stats()
        assert doc["blocks"]["storing"] == 4
        assert doc["stats"]["pins"] >= 4
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(timeout=10)
        victim.stdout.close()
        victim.stderr.close()

    # After the liveness timeout (1s) the sweep ends the session and releases everything.
    def released() -> bool:
        doc = daemon.stats()
        return (doc["blocks"]["storing"] == 0 and doc["blocks"]["pinned"] == 0
                and doc["stats"]["pins"] == 0 and doc["sessions"] == 1)

    wait_until(released, 10, "the killed client's pins and pending stores to be released")
    # Its half-written blocks never became visible; the keys can be stored again, whole.
    states = list(writer.lookup(keys).states)
    assert states == [HIT] * 4 + [MISS] * 4
    grant = writer.store(keys[4:])
    assert list(grant.keys_to_store) == keys[4:]
    assert writer.load(keys) == [block_bytes_of(k) for k in keys]


def test_reset_with_stores_in_flight(daemon: Daemon, engines):
    engine = engines()
    done, pending = keys_for("reset-done", 3), keys_for("reset-pending", 3)
    engine.store(done)
    grant = engine.store(pending, complete=False)
    loading = engine.call("PrepareLoad", kvd_pb2.PrepareLoadRequest(keys=done[:1], req_id="l"))

    out = daemon.kvd("reset", "--yes")
    assert out.returncode == 0, out.stderr
    assert "dropped" in out.stdout

    doc = daemon.stats()
    assert doc["blocks"]["ready"] == 0
    assert doc["blocks"]["zombie"] == 4  # 3 stores in flight + 1 pinned load keep their slots

    # The completions carry the old epoch: ignored, nothing becomes visible.
    answer = engine.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
        keys=grant.keys_to_store, success=True, req_id="r", epoch=grant.epoch,
        slot_offsets=grant.slot_offsets))
    assert answer.ignored
    assert engine.call("CompleteLoad", kvd_pb2.CompleteLoadRequest(
        keys=done[:1], req_id="l", epoch=loading.epoch)).ignored
    assert list(engine.lookup(done + pending).states) == [MISS] * 6
    doc = daemon.stats()
    assert doc["blocks"]["zombie"] == 0 and doc["blocks"]["total"] == 0

    # The namespace works in the new epoch.
    new_epoch = engine.store(pending).epoch
    assert new_epoch > grant.epoch
    assert engine.load(pending) == [block_bytes_of(k) for k in pending]


def test_drain_refuses_stores_and_waits_for_loads(daemon: Daemon, engines):
    import grpc

    engine = engines()
    keys = keys_for("drain", 2)
    engine.store(keys)
    pin = engine.call("PrepareLoad", kvd_pb2.PrepareLoadRequest(keys=keys, req_id="d"))
    assert daemon.kvd("drain").returncode == 0

    wait_until(lambda: daemon.kvd("health").returncode == 1, 10, "health NOT_SERVING")
    with pytest.raises(grpc.RpcError) as info:
        engine.call("PrepareStore", kvd_pb2.PrepareStoreRequest(keys=keys_for("late", 1)))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert daemon.proc.poll() is None  # still waiting for the load in flight
    assert engine.load(keys) == [block_bytes_of(k) for k in keys]  # loads still work
    engine.call("CompleteLoad", kvd_pb2.CompleteLoadRequest(keys=keys, req_id="d",
                                                            epoch=pin.epoch))
    assert daemon.proc.wait(timeout=10) == 0


def test_closing_the_stream_ends_the_session_at_once(start_daemon):
    import grpc

    from tests.support.daemon import clean_env
    from tests.support.engine import Engine

    # A long liveness timeout, so only the stream's end can explain the session ending.
    daemon = start_daemon("--pool-size", "4MiB", "--extent-size", "1MiB",
                          env=clean_env(KVD_MANAGER_LIVENESS_TIMEOUT="30s"))
    engine = Engine(daemon.socket)
    try:
        wait_until(lambda: engine.notices, 5, "a heartbeat answer")
        engine._stop.set()  # the client ends its heartbeat stream
        engine._stream.join(timeout=5)

        def ended() -> bool:
            try:
                engine.lookup([b"k"])
            except grpc.RpcError as exc:
                return exc.code() == grpc.StatusCode.UNAUTHENTICATED
            return False

        wait_until(ended, 5, "the session to end with its stream")
        assert daemon.stats()["sessions"] == 0
    finally:
        engine.close()


def test_dataplane_attach_maps_the_pool_without_a_session(daemon: Daemon, engines):
    from kvd_client.attach import attach
    from kvd_client.pool_map import PoolMapping

    engine = engines()
    keys = keys_for("worker", 2)
    grant = engine.store(keys)
    info = attach(daemon.socket, role="dataplane", timeout=5)
    assert info.token == "" and info.session_id == ""
    assert info.pool_bytes == engine.pool_bytes and info.pool_id == engine.info.pool_id
    worker = PoolMapping(info.fd, info.pool_bytes)
    try:
        view = worker.view(grant.slot_offsets[1], engine.block)
        assert bytes(view) == block_bytes_of(keys[1])  # the worker sees what the engine wrote
        view.release()
    finally:
        worker.close()
    assert daemon.stats()["sessions"] == 1


@pytest.mark.parametrize("stream", [True, False], ids=["step-stream", "unary-step"])
def test_kvd_client_steps_on_its_stream_or_unary(daemon, monkeypatch, stream):
    from kvd_client import client as client_module
    from kvd_client.client import KvdClient
    from kvd_proto.wire import KvLayout

    monkeypatch.setattr(client_module, "USE_STEP_STREAM", stream)
    c = KvdClient(daemon.socket, model="stream-model",
                  layout=KvLayout(4096, 1, 4096, 16, "bf16"), deadline_s=2.0)
    try:
        assert c.wait_available(10)
        keys = keys_for("client-stream", 3)
        calls_before = daemon.stats()["rpc"].get("Step", {}).get("calls_total", 0)
        (res,) = c.step([kvd_pb2.StepOp(prepare_store=kvd_pb2.PrepareStoreRequest(keys=keys))])
        ps = res.prepare_store
        c.queue(kvd_pb2.StepOp(complete_store=kvd_pb2.CompleteStoreRequest(
            keys=ps.keys_to_store, success=True, epoch=ps.epoch)))
        (res,) = c.step([kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(keys=keys))])
        assert list(res.lookup.states) == [kvd_pb2.BLOCK_STATE_HIT] * 3
        # A step the daemon rejects is dropped; the client stays up and keeps stepping.
        assert c.step([kvd_pb2.StepOp()]) is None and c.available
        (res,) = c.step([kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(keys=keys))])
        assert list(res.lookup.states) == [kvd_pb2.BLOCK_STATE_HIT] * 3
        assert c.round_trips == 4
        assert (c._steps is not None) == stream
        assert daemon.stats()["rpc"]["Step"]["calls_total"] - calls_before == 4
    finally:
        c.close()
