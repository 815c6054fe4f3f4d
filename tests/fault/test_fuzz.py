"""Fuzz the wire: random, mutated and oversized requests to every engine RPC, to Step and to
StepStream (one stream for the whole run, which in-band rejections must not close), the
shared-index protocol's ops (Grant, StoreGranted, Pin) among them.

Every answer must be OK or one of the documented status codes (never UNKNOWN or INTERNAL),
the daemon must keep serving, and a rejected call must leave the index unchanged.
`KVD_SOAK_FUZZ` sets the number of cases (300 in `make test`).
"""

from __future__ import annotations

import json
import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd_proto import kvd_pb2
from tests.support.engine import Engine
from tests.support.summary import record

pytestmark = [pytest.mark.fault, pytest.mark.multiproc]
CASES = int(os.environ.get("KVD_SOAK_FUZZ", "300"))
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND}

keys = st.lists(st.one_of(st.binary(min_size=0, max_size=140),
                          st.sampled_from([b"k1", b"k2", b"k3", b"k4"])), max_size=12)
epochs = st.one_of(st.just(0), st.integers(0, 2**64 - 1))
offsets = st.lists(st.integers(0, 2**64 - 1), max_size=12)
req_ids = st.one_of(st.just(""), st.text(max_size=300))
positions = st.lists(st.integers(0, 2**64 - 1), max_size=12)
# Offsets a Grant may have answered (slots of 4 KiB in the namespace's first extents), so that
# StoreGranted and Pin also name real slots, the session's own or not, besides any number.
slot_offsets = st.one_of(st.integers(0, 2047).map(lambda i: i * 4096), st.integers(0, 2**64 - 1))


@st.composite
def store_granted_ops(draw: st.DrawFn) -> kvd_pb2.StepOp:
    """Granted keys a subset of the offered ones or not, one offset per key or not."""
    offered = draw(keys)
    granted = draw(st.one_of(st.just(offered), keys,
                             st.lists(st.sampled_from(offered), max_size=len(offered))
                             if offered else st.just([])))
    return kvd_pb2.StepOp(store_granted=kvd_pb2.StoreGrantedRequest(
        keys=offered, req_id=draw(req_ids), positions=draw(positions), granted_keys=granted,
        granted_offsets=draw(st.one_of(
            st.lists(slot_offsets, min_size=len(granted), max_size=len(granted)), offsets))))


@st.composite
def pin_ops(draw: st.DrawFn) -> kvd_pb2.StepOp:
    """One offset per key (where the engine read it) or not."""
    ks = draw(keys)
    return kvd_pb2.StepOp(pin=kvd_pb2.PinRequest(
        keys=ks, req_id=draw(req_ids), positions=draw(positions), slot_offsets=draw(st.one_of(
            st.lists(slot_offsets, min_size=len(ks), max_size=len(ks)), offsets))))


ops = st.one_of(
    st.builds(lambda k, p, ms, r: kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(
        keys=k, prefix=p, lease_ms=ms, req_id=r)), keys, st.booleans(),
        st.integers(0, 2**32 - 1), req_ids),
    st.builds(lambda k, r, p: kvd_pb2.StepOp(prepare_load=kvd_pb2.PrepareLoadRequest(
        keys=k, req_id=r, positions=p)), keys, req_ids, positions),
    st.builds(lambda k, e: kvd_pb2.StepOp(complete_load=kvd_pb2.CompleteLoadRequest(
        keys=k, epoch=e)), keys, epochs),
    st.builds(lambda k, r, p: kvd_pb2.StepOp(prepare_store=kvd_pb2.PrepareStoreRequest(
        keys=k, req_id=r, positions=p)), keys, req_ids, positions),
    st.builds(lambda k, s, e, o: kvd_pb2.StepOp(complete_store=kvd_pb2.CompleteStoreRequest(
        keys=k, success=s, epoch=e, slot_offsets=o)), keys, st.booleans(), epochs, offsets),
    st.builds(lambda k, r: kvd_pb2.StepOp(touch=kvd_pb2.TouchRequest(keys=k, req_id=r)),
              keys, req_ids),
    st.builds(lambda r: kvd_pb2.StepOp(request_finished=kvd_pb2.RequestFinishedRequest(
        req_id=r)), req_ids),
    st.builds(lambda m: kvd_pb2.StepOp(take_events=kvd_pb2.TakeEventsRequest(max_events=m)),
              st.integers(0, 2**32 - 1)),
    st.builds(lambda n, e: kvd_pb2.StepOp(grant=kvd_pb2.GrantRequest(count=n, evict=e)),
              st.one_of(st.integers(0, 16), st.integers(0, 2**32 - 1)), st.booleans()),
    store_granted_ops(),
    pin_ops(),
    st.just(kvd_pb2.StepOp()),
)
tokens = st.sampled_from(["good", "none", "garbage"])


class _InBand(Exception):
    """A StepStream answer with error_code set, shaped like a grpc.RpcError."""

    def __init__(self, answer: kvd_pb2.StepResponse) -> None:
        super().__init__(answer.error_message)
        self.answer = answer

    def code(self) -> grpc.StatusCode:
        return {c.value[0]: c for c in grpc.StatusCode}[self.answer.error_code]

    def details(self) -> str:
        return self.answer.error_message


def _index(daemon) -> tuple:
    doc = daemon.stats()
    return (json.dumps(doc["blocks"], sort_keys=True), doc["pool"]["used_bytes"],
            doc["stats"]["pins"], doc["stats"]["leases"])


@pytest.fixture
def target(daemon):
    engine = Engine(daemon.socket, "fuzz-model", block=4096)
    engine.store([b"k1", b"k2"])
    yield daemon, engine
    engine.close()


def test_fuzz_step_and_unary_rpcs(target):
    import queue

    daemon, engine = target
    # One StepStream for every "stream" case: in-band rejections must leave it open.
    stream_requests: queue.SimpleQueue = queue.SimpleQueue()
    stream = engine.stub.StepStream(iter(stream_requests.get, None), metadata=engine.md)

    @settings(max_examples=CASES, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(ops, max_size=6), token=tokens,
           mode=st.sampled_from(["step", "unary", "stream"]))
    def case(batch, token, mode):
        unary = mode == "unary"
        record("fuzz cases")
        md = {"good": engine.md, "none": (),
              "garbage": (("kvd-session-token", "x" * 70),)}[token]
        before = _index(daemon)
        try:
            if unary and batch and batch[0].WhichOneof("op"):
                kind = batch[0].WhichOneof("op")
                method = {"lookup": "Lookup", "prepare_load": "PrepareLoad",
                          "complete_load": "CompleteLoad", "prepare_store": "PrepareStore",
                          "complete_store": "CompleteStore", "touch": "Touch",
                          "request_finished": "RequestFinished", "take_events": "TakeEvents",
                          "grant": None, "store_granted": None,
                          "pin": None}[kind]   # the fast-path ops are step ops only
                if method is None:
                    return
                getattr(engine.stub, method)(getattr(batch[0], kind), metadata=md, timeout=5)
            elif mode == "stream" and token == "good":
                stream_requests.put(kvd_pb2.StepRequest(ops=batch))
                answer = next(stream)
                if answer.error_code:
                    raise _InBand(answer)
            else:
                engine.stub.Step(kvd_pb2.StepRequest(ops=batch), metadata=md, timeout=5)
            code = grpc.StatusCode.OK
        except (grpc.RpcError, _InBand) as err:
            code = err.code()
            assert code in ALLOWED, f"{code}: {err.details()}"
            if code in (grpc.StatusCode.UNAUTHENTICATED,) or (code != grpc.StatusCode.OK
                                                              and len(batch) <= 1):
                assert _index(daemon) == before, "a rejected call changed the index"
        # clean up whatever a successful call reserved or pinned
        if code == grpc.StatusCode.OK and token == "good":
            engine.stub.Step(kvd_pb2.StepRequest(ops=[kvd_pb2.StepOp(
                reset=kvd_pb2.ResetRequest())]), metadata=engine.md, timeout=5)

    case()
    stream_requests.put(None)
    record("daemon crashes", int(daemon.proc.poll() is not None))
    assert daemon.serving()
    assert "Traceback" not in daemon.log()
