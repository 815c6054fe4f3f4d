"""kvd.v1.KvdEngine: the engine's gRPC service, a thin shell around the core and the engine
protocols (kvd_server/protocols/): every request checked (validation.py), turned into core
calls and back, each handler run through the recorder (recorder.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import grpc
from google.protobuf.message import Message

from kvd_proto import kvd_pb2, kvd_pb2_grpc
from kvd_proto.wire import (
    DEFAULT_EVENTS,
    MAX_EVENTS,
    MAX_GRANTED_SLOTS,
    MAX_KEYS_PER_STEP,
    MAX_OPS_PER_STEP,
    SESSION_TOKEN_METADATA,
    SLOT_ALIGNMENT,
    KvLayout,
)
from kvd_server import __version__
from kvd_server.config import Config
from kvd_server.core.core import DaemonState, KvdCore
from kvd_server.core.sessions import EngineInfo, Session
from kvd_server.errors import (
    InvalidArgument,
    KvdError,
    Unauthenticated,
    prefixed,
)
from kvd_server.protocols.wiring import EngineProtocols
from kvd_server.rpc.recorder import RpcRecorder, grpc_status, is_server_stopping
from kvd_server.rpc.validation import (
    check_keys,
    check_positions,
    check_size,
    check_str,
    metadata_value,
    op_keys,
)

log = logging.getLogger(__name__)

_DAEMON_STATE = {
    DaemonState.STARTING: kvd_pb2.DAEMON_STATE_STARTING,
    DaemonState.SERVING: kvd_pb2.DAEMON_STATE_SERVING,
    DaemonState.DRAINING: kvd_pb2.DAEMON_STATE_DRAINING,
}


def _unary_rpc(method: str, kind: str) -> Callable[..., Awaitable[object]]:
    """The unary RPC `method` of KvdEngine: the per-op handler `kind` for the caller's session
    (the same handler a Step runs for an op of that kind)."""

    async def rpc(self: EngineService, request: Message,
                  context: grpc.aio.ServicerContext) -> object:
        op = self._OPS[kind]

        def handle() -> object:
            check_size(request)
            return op(self, self._session(context), request)

        return await self._rpc.unary(method, context, handle)

    rpc.__name__ = rpc.__qualname__ = method
    return rpc


class EngineService(kvd_pb2_grpc.KvdEngineServicer):
    """kvd.v1.KvdEngine: one engine session per token."""

    def __init__(self, core: KvdCore, protocols: EngineProtocols, config: Config,
                 pool_bytes: int, rpc: RpcRecorder) -> None:
        self._core = core
        self._callpath = protocols.callpath
        self._fastpath = protocols.fastpath
        self._completions = protocols.completions
        self._config = config
        self._pool_bytes = pool_bytes
        self._rpc = rpc
        self.step_calls = 0
        self.step_ops = 0

    # -- session plumbing

    def _session(self, context: grpc.aio.ServicerContext) -> Session:
        token = metadata_value(context, SESSION_TOKEN_METADATA)
        if not token:
            raise Unauthenticated(f"missing session token (metadata {SESSION_TOKEN_METADATA}); "
                                  "attach first")
        return self._core.authenticate(token)

    # -- per-operation handlers shared by the unary RPCs and Step

    def _lookup(self, s: Session, req: kvd_pb2.LookupRequest) -> kvd_pb2.LookupResponse:
        keys = check_keys(req.keys)
        req_id = check_str(req.req_id, "req_id")
        answer = self._callpath.lookup(s, keys, prefix=req.prefix,
                                            lease_ms=req.lease_ms, req_id=req_id)
        out = kvd_pb2.LookupResponse(states=[int(state) for state in answer.states],
                                     epoch=answer.epoch)
        if answer.offsets is not None:
            out.slot_offsets.extend(answer.offsets)
            out.lease_ms = round(answer.lease_s * 1000)
        return out

    def _prepare_load(self, s: Session,
                      req: kvd_pb2.PrepareLoadRequest) -> kvd_pb2.PrepareLoadResponse:
        keys = check_keys(req.keys)
        req_id = check_str(req.req_id, "req_id")
        positions = check_positions(req.positions, len(keys))
        answer = self._callpath.prepare_load(s, keys, req_id, positions)
        return kvd_pb2.PrepareLoadResponse(slot_offsets=answer.offsets, epoch=answer.epoch)

    def _complete_load(self, s: Session,
                       req: kvd_pb2.CompleteLoadRequest) -> kvd_pb2.CompleteLoadResponse:
        keys = check_keys(req.keys)
        req_id = check_str(req.req_id, "req_id")
        ignored = self._completions.complete_load(s, keys, req_id, req.epoch)
        return kvd_pb2.CompleteLoadResponse(ignored=ignored)

    def _touch(self, s: Session, req: kvd_pb2.TouchRequest) -> kvd_pb2.TouchResponse:
        keys = check_keys(req.keys)
        self._core.touch(s, keys, check_str(req.req_id, "req_id"))
        return kvd_pb2.TouchResponse()

    def _prepare_store(self, s: Session,
                       req: kvd_pb2.PrepareStoreRequest) -> kvd_pb2.PrepareStoreResponse:
        keys = check_keys(req.keys)
        req_id = check_str(req.req_id, "req_id")
        positions = check_positions(req.positions, len(keys))
        decision, epoch = self._callpath.prepare_store(s, keys, req_id, positions)
        return kvd_pb2.PrepareStoreResponse(
            cannot_store=decision.cannot_store,
            keys_to_store=decision.keys_to_store,
            slot_offsets=decision.slot_offsets,
            evicted_keys=decision.evicted_keys,
            epoch=epoch,
        )

    def _complete_store(self, s: Session,
                        req: kvd_pb2.CompleteStoreRequest) -> kvd_pb2.CompleteStoreResponse:
        keys = check_keys(req.keys)
        req_id = check_str(req.req_id, "req_id")
        offsets: list[int] | None = None
        if req.slot_offsets:
            if len(req.slot_offsets) != len(keys):
                raise InvalidArgument(f"slot_offsets has {len(req.slot_offsets)} entries for "
                                      f"{len(keys)} keys (must be empty or one per key)")
            for i, offset in enumerate(req.slot_offsets):
                if offset >= self._pool_bytes or offset % SLOT_ALIGNMENT:
                    raise InvalidArgument(f"slot_offsets[{i}] = {offset} is not a slot offset "
                                          f"(outside the {self._pool_bytes}-byte pool or not "
                                          f"{SLOT_ALIGNMENT}-aligned)")
            offsets = list(req.slot_offsets)
        result = self._completions.complete_store(s, keys, req.success, req_id,
                                                       req.epoch, offsets)
        return kvd_pb2.CompleteStoreResponse(ignored=result.ignored, completed=result.completed,
                                             mismatched=result.mismatched)

    def _request_finished(self, s: Session, req: kvd_pb2.RequestFinishedRequest
                          ) -> kvd_pb2.RequestFinishedResponse:
        self._core.request_finished(s, check_str(req.req_id, "req_id"))
        return kvd_pb2.RequestFinishedResponse()

    def _take_events(self, s: Session,
                     req: kvd_pb2.TakeEventsRequest) -> kvd_pb2.TakeEventsResponse:
        if req.max_events > MAX_EVENTS:
            raise InvalidArgument(f"max_events {req.max_events} is more than {MAX_EVENTS}")
        batch = self._core.take_events(s, req.max_events or DEFAULT_EVENTS)
        return kvd_pb2.TakeEventsResponse(
            events=[kvd_pb2.OffloadEvent(keys=e.keys, removed=e.removed,
                                         metadata_only=e.metadata_only) for e in batch.events],
            more=batch.more,
            events_dropped=batch.dropped,
        )

    def _reset(self, s: Session, req: kvd_pb2.ResetRequest) -> kvd_pb2.ResetResponse:
        answer = self._core.reset_namespace(s)
        return kvd_pb2.ResetResponse(epoch=answer.epoch, dropped_blocks=answer.dropped)

    def _release_held(self, s: Session, req: kvd_pb2.ReleaseHeldRequest
                      ) -> kvd_pb2.ReleaseHeldResponse:
        pins, slots = self._core.release_held(s, check_str(req.session_id, "session_id"))
        return kvd_pb2.ReleaseHeldResponse(released_pins=pins, released_slots=slots)

    def _hint(self, s: Session, req: kvd_pb2.HintRequest) -> kvd_pb2.HintResponse:
        self._core.retention.hint(s, check_str(req.req_id, "req_id"),
                                  check_str(req.session, "session"), req.retain_ms)
        return kvd_pb2.HintResponse()

    def _grant(self, s: Session, req: kvd_pb2.GrantRequest) -> kvd_pb2.GrantResponse:
        if req.count > MAX_GRANTED_SLOTS:
            raise InvalidArgument(f"count {req.count} is more than MAX_GRANTED_SLOTS "
                                  f"({MAX_GRANTED_SLOTS})")
        return kvd_pb2.GrantResponse(slot_offsets=self._fastpath.grant(s, req.count,
                                                                           req.evict))

    def _store_granted(self, s: Session, req: kvd_pb2.StoreGrantedRequest
                       ) -> kvd_pb2.StoreGrantedResponse:
        keys = check_keys(req.keys)
        granted = check_keys(req.granted_keys, "granted_keys")
        if len(req.granted_offsets) != len(granted):
            raise InvalidArgument(f"granted_offsets has {len(req.granted_offsets)} entries for "
                                  f"{len(granted)} granted_keys (one per key)")
        positions = check_positions(req.positions, len(keys))
        answer = self._fastpath.store_granted(s, keys, check_str(req.req_id, "req_id"), positions,
                                          granted, list(req.granted_offsets))
        return kvd_pb2.StoreGrantedResponse(
            accepted=answer.accepted, duplicates=answer.duplicates, refused=answer.refused,
            evicted_keys=answer.evicted, epoch=answer.epoch)

    def _pin(self, s: Session, req: kvd_pb2.PinRequest) -> kvd_pb2.PinResponse:
        keys = check_keys(req.keys)
        if len(req.slot_offsets) != len(keys):
            raise InvalidArgument(f"slot_offsets has {len(req.slot_offsets)} entries for "
                                  f"{len(keys)} keys (one per key)")
        positions = check_positions(req.positions, len(keys))
        pinned, epoch = self._fastpath.pin_loads(s, keys, list(req.slot_offsets),
                                             check_str(req.req_id, "req_id"), positions)
        return kvd_pb2.PinResponse(pinned=pinned, epoch=epoch)

    _OPS = {
        "lookup": _lookup,
        "prepare_load": _prepare_load,
        "complete_load": _complete_load,
        "touch": _touch,
        "prepare_store": _prepare_store,
        "complete_store": _complete_store,
        "request_finished": _request_finished,
        "take_events": _take_events,
        "reset": _reset,
        "release_held": _release_held,
        "grant": _grant,
        "store_granted": _store_granted,
        "pin": _pin,
        "hint": _hint,
    }

    # -- RPCs

    def _register(self, context: grpc.aio.ServicerContext,
                  request: kvd_pb2.RegisterSessionRequest) -> kvd_pb2.RegisterSessionResponse:
        check_size(request)
        s = self._session(context)
        e, lay = request.engine, request.layout
        for name in ("engine_id", "engine_kind", "engine_version", "hostname"):
            check_str(getattr(e, name), f"engine.{name}", identity=True)
        model = check_str(request.model, "model", required=True, identity=True)
        salt = check_str(request.layout_salt, "layout_salt", identity=True)
        check_str(lay.dtype, "layout.dtype", identity=True)
        try:
            layout = KvLayout(block_bytes=lay.block_bytes, num_ranks=lay.num_ranks,
                              shard_bytes=lay.shard_bytes, tokens_per_block=lay.tokens_per_block,
                              dtype=lay.dtype, max_key_bytes=lay.max_key_bytes)
        except ValueError as exc:
            raise InvalidArgument(f"layout: {exc}") from None
        reg = self._core.register(
            s,
            EngineInfo(engine_id=e.engine_id, engine_kind=e.engine_kind,
                       engine_version=e.engine_version, pid=e.pid, hostname=e.hostname),
            model, layout, salt)
        m = self._config.manager
        return kvd_pb2.RegisterSessionResponse(
            session_id=reg.session_id, namespace_id=reg.namespace_id, epoch=reg.epoch,
            slot_bytes=reg.slot_bytes, pool_bytes=self._pool_bytes,
            heartbeat_interval_ms=round(m.heartbeat_interval * 1000),
            liveness_timeout_ms=round(m.liveness_timeout * 1000),
            default_lease_ms=round(m.default_lease * 1000),
            daemon_version=__version__, tenant=reg.tenant,
        )

    async def RegisterSession(self, request: kvd_pb2.RegisterSessionRequest,
                              context: grpc.aio.ServicerContext
                              ) -> kvd_pb2.RegisterSessionResponse:
        return await self._rpc.unary("RegisterSession", context,
                                     lambda: self._register(context, request))

    Lookup = _unary_rpc("Lookup", "lookup")
    PrepareLoad = _unary_rpc("PrepareLoad", "prepare_load")
    CompleteLoad = _unary_rpc("CompleteLoad", "complete_load")
    Touch = _unary_rpc("Touch", "touch")
    PrepareStore = _unary_rpc("PrepareStore", "prepare_store")
    CompleteStore = _unary_rpc("CompleteStore", "complete_store")
    RequestFinished = _unary_rpc("RequestFinished", "request_finished")
    TakeEvents = _unary_rpc("TakeEvents", "take_events")
    Reset = _unary_rpc("Reset", "reset")
    ReleaseHeld = _unary_rpc("ReleaseHeld", "release_held")
    Hint = _unary_rpc("Hint", "hint")

    def _run_step(self, s: Session, request: kvd_pb2.StepRequest) -> kvd_pb2.StepResponse:
        """One step for Step and StepStream: bounds first, then the ops in order."""
        check_size(request)
        ops = request.ops
        if len(ops) > MAX_OPS_PER_STEP:
            raise InvalidArgument(f"step has {len(ops)} ops, more than MAX_OPS_PER_STEP "
                                  f"({MAX_OPS_PER_STEP})")
        total = 0
        for i, op in enumerate(ops):
            if op.WhichOneof("op") is None:
                raise InvalidArgument(f"op #{i} carries no operation")
            total += op_keys(op)
        if total > MAX_KEYS_PER_STEP:
            raise InvalidArgument(f"step carries {total} keys over its ops, more than "
                                  f"MAX_KEYS_PER_STEP ({MAX_KEYS_PER_STEP})")
        self.step_calls += 1
        self.step_ops += len(ops)
        self._rpc.observe_step(len(ops), total)
        out = kvd_pb2.StepResponse()
        for i, op in enumerate(ops):
            kind = op.WhichOneof("op")
            assert kind is not None
            try:
                result = self._OPS[kind](self, s, getattr(op, kind))
            except KvdError as exc:
                raise prefixed(exc, f"op #{i} ({kind})") from exc
            getattr(out.results.add(), kind).CopyFrom(result)
        out.epoch = s.epoch
        return out

    async def Step(self, request: kvd_pb2.StepRequest,
                   context: grpc.aio.ServicerContext) -> kvd_pb2.StepResponse:
        return await self._rpc.unary(
            "Step", context, lambda: self._run_step(self._session(context), request))

    async def StepStream(self, request_iterator: AsyncIterator[kvd_pb2.StepRequest],
                         context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[kvd_pb2.StepResponse]:
        """Steps on one stream; each is recorded as a `Step` call. Rejections are in-band;
        only a session that is gone ends the stream (UNAUTHENTICATED)."""
        try:
            self._session(context)
        except KvdError as exc:
            self._rpc.record("Step", 0.0, exc.code)
            await context.abort(grpc_status(exc.code), exc.message)
        token = metadata_value(context, SESSION_TOKEN_METADATA) or ""
        requests = aiter(request_iterator)
        while True:
            try:
                request = await anext(requests)
            except StopAsyncIteration:
                return
            except Exception as exc:
                if is_server_stopping(exc):
                    return  # the daemon is stopping: the stream ends with it
                raise
            session = self._core.sessions.get(token)
            if session is None:        # the session is gone: end the stream
                self._rpc.record("Step", 0.0, Unauthenticated.code)
                await context.abort(grpc_status(Unauthenticated.code),
                                    "unknown or expired session token; attach again")
            assert session is not None
            self._core.heartbeat(session)
            outcome = self._rpc.run("Step", partial(self._run_step, session, request))
            if outcome.ok:
                yield outcome.response  # type: ignore[misc]
            else:
                yield kvd_pb2.StepResponse(error_code=grpc_status(outcome.code).value[0],
                                           error_message=outcome.message)

    def _close(self, context: grpc.aio.ServicerContext) -> kvd_pb2.CloseSessionResponse:
        token = metadata_value(context, SESSION_TOKEN_METADATA)
        if not token:
            raise Unauthenticated(f"missing session token (metadata {SESSION_TOKEN_METADATA})")
        s = self._core.sessions.get(token)
        if s is not None:   # an unknown token: already closed (idempotent)
            self._core.close_session(s, "closed by client", copies_done=True)
        return kvd_pb2.CloseSessionResponse()

    async def CloseSession(self, request: kvd_pb2.CloseSessionRequest,
                           context: grpc.aio.ServicerContext) -> kvd_pb2.CloseSessionResponse:
        return await self._rpc.unary("CloseSession", context, lambda: self._close(context))

    async def SessionStream(self, request_iterator: AsyncIterator[kvd_pb2.SessionHeartbeat],
                            context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[kvd_pb2.SessionNotice]:
        """Answer each heartbeat; the stream ending (or the client cancelling) ends the session.
        The whole stream is recorded as one SessionStream call when it ends."""
        method = "SessionStream"
        start = time.perf_counter()
        try:
            s = self._session(context)
        except KvdError as exc:
            self._rpc.record(method, time.perf_counter() - start, exc.code)
            await context.abort(grpc_status(exc.code), exc.message)
        reason = "session stream closed"
        code = "OK"
        try:
            async for heartbeat in request_iterator:
                self._core.heartbeat(s)
                yield kvd_pb2.SessionNotice(seq=heartbeat.seq, epoch=s.epoch,
                                            state=_DAEMON_STATE[self._core.state])
        except asyncio.CancelledError:
            reason, code = "session stream cancelled", "CANCELLED"
            raise
        except Exception as exc:
            if is_server_stopping(exc):
                # The daemon is stopping (drain done): streams end with it; not an error.
                reason, code = "daemon stopped", "UNAVAILABLE"
                return
            log.exception("SessionStream failed")
            reason, code = "session stream failed", "INTERNAL"
            await context.abort(grpc_status(code), "internal error (see the daemon's log)")
        finally:
            try:
                self._core.close_session(s, reason)
            except Exception:
                log.exception("closing session after its stream ended failed")
            self._rpc.record(method, time.perf_counter() - start, code)


# --- admin service -------------------------------------------------------------------------
