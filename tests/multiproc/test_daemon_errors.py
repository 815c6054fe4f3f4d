"""Every bad request gets its status code and a message naming the bound and the index."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvd_proto import kvd_pb2, kvd_pb2_grpc
from tests.support.daemon import POOL, Daemon, spawn_daemon, target
from tests.support.engine import TOKEN, Engine, keys_for

pytestmark = pytest.mark.multiproc

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def shared() -> Iterator[Daemon]:
    """One daemon for the read-mostly error cases of this module."""
    workdir = Path(tempfile.mkdtemp(prefix="kvd-e-", dir="/tmp"))
    daemon = spawn_daemon(workdir, "--pool-size", POOL, "--extent-size", "4MiB")
    try:
        yield daemon
        daemon.close()
        assert "Traceback" not in daemon.log(), daemon.log()
    finally:
        daemon.close()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def engine(shared: Daemon) -> Iterator[Engine]:
    e = Engine(shared.socket)
    try:
        yield e
    finally:
        e.close()


def expect(code: grpc.StatusCode, call, *fragments: str) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    details = info.value.details()
    for fragment in fragments:
        assert fragment in details, details
    return details


def test_no_token_and_bad_token_are_unauthenticated(shared: Daemon):
    with grpc.insecure_channel(target(shared.socket)) as ch:
        stub = kvd_pb2_grpc.KvdEngineStub(ch)
        req = kvd_pb2.LookupRequest(keys=[b"k"])
        expect(grpc.StatusCode.UNAUTHENTICATED, lambda: stub.Lookup(req, timeout=5),
               TOKEN)
        expect(grpc.StatusCode.UNAUTHENTICATED,
               lambda: stub.Lookup(req, metadata=((TOKEN, "0" * 64),), timeout=5))
        expect(grpc.StatusCode.UNAUTHENTICATED,
               lambda: stub.Step(kvd_pb2.StepRequest(), timeout=5))


def test_key_bounds(engine: Engine):
    too_many = [i.to_bytes(4, "big") for i in range(4097)]
    expect(INVALID, lambda: engine.lookup(too_many), "MAX_KEYS_PER_CALL", "4096")
    expect(INVALID, lambda: engine.lookup([b"a", b"b", b"x" * 129]), "keys[2]",
           "MAX_KEY_BYTES")
    expect(INVALID, lambda: engine.lookup([b"a", b""]), "keys[1]", "empty")
    expect(INVALID, lambda: engine.lookup([b"a", b"b", b"a"]), "keys[2]", "keys[0]",
           "duplicate")
    expect(INVALID, lambda: engine.call("PrepareStore", kvd_pb2.PrepareStoreRequest(
        keys=[b"a", b"a"])), "duplicate")
    # The largest legal call is fine.
    assert len(engine.lookup([i.to_bytes(128, "big") for i in range(4096)]).states) >= 1


def test_string_positions_and_event_bounds(engine: Engine):
    expect(INVALID, lambda: engine.call("Lookup", kvd_pb2.LookupRequest(
        keys=[b"a"], req_id="r" * 257)), "req_id", "256")
    expect(INVALID, lambda: engine.call("PrepareStore", kvd_pb2.PrepareStoreRequest(
        keys=[b"a", b"b"], positions=[1])), "positions")
    expect(INVALID, lambda: engine.call("TakeEvents", kvd_pb2.TakeEventsRequest(
        max_events=65537)), "max_events")


def test_bad_slot_offsets(engine: Engine):
    keys = keys_for("offsets", 2)
    grant = engine.store(keys, complete=False)
    pool = engine.pool_bytes
    for bad in (pool, pool + 4096, grant.slot_offsets[1] + 1):
        expect(INVALID, lambda bad=bad: engine.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
            keys=keys, success=True, epoch=grant.epoch,
            slot_offsets=[grant.slot_offsets[0], bad])), "slot_offsets[1]")
    expect(INVALID, lambda: engine.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
        keys=keys, success=True, epoch=grant.epoch, slot_offsets=[grant.slot_offsets[0]])),
        "slot_offsets")
    # Swapped (valid but wrong) offsets are not errors: the keys are counted as mismatched.
    swapped = engine.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
        keys=keys, success=True, epoch=grant.epoch,
        slot_offsets=list(reversed(grant.slot_offsets))))
    assert swapped.mismatched == 2 and swapped.completed == 0
    done = engine.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
        keys=keys, success=True, epoch=grant.epoch, slot_offsets=grant.slot_offsets))
    assert done.completed == 2


def test_step_bounds_and_failing_op_index(engine: Engine):
    lookup = kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(keys=[b"a"]))
    expect(INVALID, lambda: engine.call("Step", kvd_pb2.StepRequest(ops=[lookup] * 257)),
           "MAX_OPS_PER_STEP")
    big = kvd_pb2.StepOp(touch=kvd_pb2.TouchRequest(
        keys=[i.to_bytes(4, "big") for i in range(4096)]))
    expect(INVALID, lambda: engine.call("Step", kvd_pb2.StepRequest(ops=[big] * 5)),
           "MAX_KEYS_PER_STEP")
    expect(INVALID, lambda: engine.call("Step", kvd_pb2.StepRequest(
        ops=[lookup, kvd_pb2.StepOp()])), "op #1")
    expect(INVALID, lambda: engine.call("Step", kvd_pb2.StepRequest(ops=[
        lookup, kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(keys=[b"x", b"x"]))])),
        "op #1", "duplicate")
    missing = kvd_pb2.StepOp(prepare_load=kvd_pb2.PrepareLoadRequest(keys=[b"never-stored"]))
    expect(grpc.StatusCode.FAILED_PRECONDITION,
           lambda: engine.call("Step", kvd_pb2.StepRequest(ops=[lookup, lookup, missing])),
           "op #2")
    # A good step answers every op, in order.
    keys = keys_for("step", 2)
    out = engine.call("Step", kvd_pb2.StepRequest(ops=[
        kvd_pb2.StepOp(prepare_store=kvd_pb2.PrepareStoreRequest(keys=keys)),
        kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(keys=keys)),
    ]))
    assert [r.WhichOneof("result") for r in out.results] == ["prepare_store", "lookup"]
    assert list(out.results[1].lookup.states) == [kvd_pb2.BLOCK_STATE_HIT_PENDING] * 2


def test_unregistered_and_reregistered_sessions(shared: Daemon):
    e = Engine(shared.socket, register=False)
    try:
        expect(grpc.StatusCode.FAILED_PRECONDITION, lambda: e.lookup([b"a"]))
        e.register("model-x")
        e.register("model-x")  # same namespace again: a no-op
        expect(grpc.StatusCode.FAILED_PRECONDITION, lambda: e.register("model-y"))
    finally:
        e.close()


def test_bad_layout_and_model(shared: Daemon):
    e = Engine(shared.socket, register=False)
    try:
        bad = kvd_pb2.KvLayout(block_bytes=4096, num_ranks=2, shard_bytes=1024)
        expect(INVALID, lambda: e.call("RegisterSession", kvd_pb2.RegisterSessionRequest(
            model="m", layout=bad)), "block_bytes")
        good = kvd_pb2.KvLayout(block_bytes=4096, num_ranks=1, shard_bytes=4096)
        expect(INVALID, lambda: e.call("RegisterSession", kvd_pb2.RegisterSessionRequest(
            model="", layout=good)), "model")
        expect(INVALID, lambda: e.call("RegisterSession", kvd_pb2.RegisterSessionRequest(
            model="m" * 257, layout=good)), "model")
    finally:
        e.close()


def test_future_epoch_is_a_failed_precondition(engine: Engine):
    keys = keys_for("epoch", 1)
    grant = engine.store(keys)
    expect(grpc.StatusCode.FAILED_PRECONDITION, lambda: engine.call(
        "CompleteLoad", kvd_pb2.CompleteLoadRequest(keys=keys, epoch=grant.epoch + 5)),
        "epoch")


def test_closed_session_token_is_refused(shared: Daemon):
    e = Engine(shared.socket)
    e.call("CloseSession", kvd_pb2.CloseSessionRequest())
    e.call("CloseSession", kvd_pb2.CloseSessionRequest())  # idempotent
    expect(grpc.StatusCode.UNAUTHENTICATED, lambda: e.lookup([b"a"]))
    e.close()


def test_admin_calls(shared: Daemon, engine: Engine):
    admin = shared.admin()
    expect(grpc.StatusCode.PERMISSION_DENIED, lambda: admin.Stats(
        kvd_pb2.StatsRequest(), metadata=engine.md, timeout=5), "session token")
    expect(grpc.StatusCode.PERMISSION_DENIED, lambda: admin.Reset(
        kvd_pb2.AdminResetRequest(namespace_id="0" * 64), timeout=5), "admin token")
    expect(grpc.StatusCode.PERMISSION_DENIED, lambda: admin.Drain(
        kvd_pb2.DrainRequest(), metadata=(("kvd-admin-token", "f" * 64),), timeout=5),
        "unknown or expired")
    expect(grpc.StatusCode.NOT_FOUND, lambda: admin.Reset(
        kvd_pb2.AdminResetRequest(namespace_id="0" * 64), metadata=shared.admin_md(),
        timeout=5))
    out = shared.kvd("reset", "--namespace", "nope", "--yes")
    assert out.returncode == 1 and "NOT_FOUND" in out.stderr
    expect(INVALID, lambda: admin.ListSessions(kvd_pb2.ListSessionsRequest(limit=10001),
                                               timeout=5), "limit")
    doc = shared.stats()
    assert doc["rpc"]["Lookup"]["errors_total"] >= 0
    assert "AdminReset" in doc["rpc"]


def test_full_pool_answers_cannot_store(start_daemon):
    daemon = start_daemon("--pool-size", "16MiB", "--extent-size", "4MiB")
    e = Engine(daemon.socket, block=4 << 20)
    try:
        granted = 0
        for i in range(5):  # 16MiB of 4MiB slots: room for 4 pending stores, never a 5th
            grant = e.store(keys_for(f"full-{i}", 1), complete=False)
            if grant.cannot_store:
                break
            granted += 1
        assert granted == 4 and grant.cannot_store
        assert not grant.keys_to_store and not grant.slot_offsets
        assert daemon.stats()["pool"]["free_bytes"] == 0
    finally:
        e.close()


def test_step_stream_answers_in_order_with_in_band_errors(shared: Daemon, engine: Engine):
    import queue

    requests: queue.SimpleQueue = queue.SimpleQueue()
    call = engine.stub.StepStream(iter(requests.get, None), metadata=engine.md, timeout=30)
    lookup = kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(keys=[b"a"]))
    keys = keys_for("stream", 2)
    steps = [
        kvd_pb2.StepRequest(ops=[lookup] * 257),                                  # too many ops
        kvd_pb2.StepRequest(ops=[kvd_pb2.StepOp(prepare_store=kvd_pb2.PrepareStoreRequest(
            keys=keys))]),
        kvd_pb2.StepRequest(ops=[lookup, kvd_pb2.StepOp()]),                      # empty op #1
        kvd_pb2.StepRequest(ops=[kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(keys=keys))]),
    ]
    for step in steps:
        requests.put(step)
    answers = [next(call) for _ in steps]
    assert answers[0].error_code == INVALID.value[0]
    assert "MAX_OPS_PER_STEP" in answers[0].error_message and not answers[0].results
    assert answers[1].error_code == 0 and len(answers[1].results[0].prepare_store.keys_to_store) == 2
    assert answers[2].error_code == INVALID.value[0] and "op #1" in answers[2].error_message
    assert list(answers[3].results[0].lookup.states) == [kvd_pb2.BLOCK_STATE_HIT_PENDING] * 2
    # Every message counts as a Step call (and its errors as Step errors).
    rpc = shared.stats()["rpc"]["Step"]
    assert rpc["calls_total"] >= 4 and rpc["errors_total"] >= 2
    # The session ending ends the stream with UNAUTHENTICATED.
    engine.call("CloseSession", kvd_pb2.CloseSessionRequest())
    requests.put(kvd_pb2.StepRequest(ops=[lookup]))
    with pytest.raises(grpc.RpcError) as e:
        next(call)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    requests.put(None)


def test_step_stream_without_a_token_is_unauthenticated(shared: Daemon):
    with grpc.insecure_channel(target(shared.socket)) as ch:
        call = kvd_pb2_grpc.KvdEngineStub(ch).StepStream(iter([kvd_pb2.StepRequest()]),
                                                         timeout=5)
        with pytest.raises(grpc.RpcError) as e:
            next(call)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
