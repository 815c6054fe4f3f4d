"""gRPC servicers for kvd.v1.KvdEngine and kvd.v1.KvdAdmin.

A thin shell around `KvdCore`: check every bound the proto states (kvd_proto.wire), turn
messages into core calls and back. Every handler, unary or a message on a stream, runs through
`RpcRecorder.run`: it times the call, counts it, and maps a failure to its status in one place
(`KvdError.code`; anything else is a bug, logged once and answered INTERNAL).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from kvd_proto import kvd_pb2, kvd_pb2_grpc
from kvd_proto.wire import (
    ADMIN_TOKEN_METADATA,
    DEFAULT_EVENTS,
    DEFAULT_SESSIONS_LIMIT,
    MAX_EVENTS,
    MAX_GRANTED_SLOTS,
    MAX_KEY_BYTES,
    MAX_KEYS_PER_CALL,
    MAX_KEYS_PER_STEP,
    MAX_MESSAGE_BYTES,
    MAX_OPS_PER_STEP,
    MAX_SESSIONS_LIMIT,
    MAX_STRING_BYTES,
    SESSION_TOKEN_METADATA,
    SLOT_ALIGNMENT,
    KvLayout,
)
from kvd_server import __version__
from kvd_server.config import Config
from kvd_server.core.core import DaemonState, KvdCore
from kvd_server.core.sessions import EngineInfo, Session, SessionView
from kvd_server.errors import (
    InvalidArgument,
    KvdError,
    PermissionDenied,
    Unauthenticated,
    prefixed,
)
from kvd_server.ops.stats import RpcCount, StatsSnapshot
from kvd_server.protocols.wiring import EngineProtocols
from kvd_server.rpc.admin_tokens import AdminTokens

log = logging.getLogger(__name__)

_DAEMON_STATE = {
    DaemonState.STARTING: kvd_pb2.DAEMON_STATE_STARTING,
    DaemonState.SERVING: kvd_pb2.DAEMON_STATE_SERVING,
    DaemonState.DRAINING: kvd_pb2.DAEMON_STATE_DRAINING,
}
T = TypeVar("T")


def grpc_status(code: str) -> grpc.StatusCode:
    """The status of a KvdError code name (the one code -> status table)."""
    return grpc.StatusCode[code]


# --- validation ----------------------------------------------------------------------------


def _check_keys(keys: Sequence[bytes], field: str = "keys") -> list[bytes]:
    if len(keys) > MAX_KEYS_PER_CALL:
        raise InvalidArgument(f"{field} has {len(keys)} keys, more than MAX_KEYS_PER_CALL "
                              f"({MAX_KEYS_PER_CALL})")
    seen: dict[bytes, int] = {}
    for i, key in enumerate(keys):
        if not key:
            raise InvalidArgument(f"{field}[{i}] is empty (MAX_KEY_BYTES: keys are "
                                  f"1..{MAX_KEY_BYTES} bytes)")
        if len(key) > MAX_KEY_BYTES:
            raise InvalidArgument(f"{field}[{i}] has {len(key)} bytes, more than MAX_KEY_BYTES "
                                  f"({MAX_KEY_BYTES})")
        first = seen.setdefault(key, i)
        if first != i:
            raise InvalidArgument(f"{field}[{i}] duplicates {field}[{first}] (duplicate keys "
                                  "are not allowed within one call)")
    return list(keys)


def _check_str(value: str, field: str, *, required: bool = False,
               identity: bool = False) -> str:
    """A bounded string; `identity` strings (what names a namespace or an engine) must not
    hold control characters, so no two different identities can print or hash alike."""
    size = len(value.encode())
    if size > MAX_STRING_BYTES:
        raise InvalidArgument(f"{field} has {size} bytes, more than {MAX_STRING_BYTES}")
    if required and not size:
        raise InvalidArgument(f"{field} is required (1..{MAX_STRING_BYTES} bytes)")
    if identity:
        bad = next((c for c in value if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0), None)
        if bad is not None:
            raise InvalidArgument(f"{field} holds the control character {bad!r} "
                                  f"(U+{ord(bad):04X}); identity strings must be printable")
    return value


def _check_positions(positions: Sequence[int], n: int) -> list[int] | None:
    if not positions:
        return None
    if len(positions) != n:
        raise InvalidArgument(f"positions has {len(positions)} entries for {n} keys (must be "
                              "empty or one per key)")
    return list(positions)


def _op_keys(op: kvd_pb2.StepOp) -> int:
    kind = op.WhichOneof("op")
    if kind is None:
        return 0
    inner = getattr(op, kind)
    return len(inner.keys) if hasattr(inner, "keys") else 0


def _check_size(request: Message) -> None:
    """The stated message limit, answered as the bound it is (the transport reads up to
    TRANSPORT_MESSAGE_BYTES, so an oversized request reaches this check)."""
    size = request.ByteSize()
    if size > MAX_MESSAGE_BYTES:
        raise InvalidArgument(f"request of {size} bytes is over MAX_MESSAGE_BYTES "
                              f"({MAX_MESSAGE_BYTES}); split it")


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


# --- per-call bookkeeping ------------------------------------------------------------------


class TransferObserver(Protocol):
    """What the Prometheus side observes on the request path (metrics.RpcMetrics)."""

    def observe(self, method: str, seconds: float, code: str = "OK") -> None: ...

    def observe_step(self, ops: int, keys: int) -> None: ...

    def observe_transfer(self, load_sizes: Sequence[int], store_sizes: Sequence[int]) -> None: ...


@dataclass(slots=True)
class Outcome:
    """A handler's result: its response, or the status it failed with."""

    response: object = None
    code: str = "OK"
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code == "OK"


class RpcRecorder:
    """Counts calls and errors per method (the stats document's `rpc` section), feeds the
    Prometheus metrics when they are on, and runs every handler under the one error mapping."""

    def __init__(self, metrics: TransferObserver | None = None) -> None:
        self.counts: dict[str, RpcCount] = {}
        self._metrics = metrics

    def record(self, method: str, seconds: float, code: str) -> None:
        count = self.counts.get(method)
        if count is None:
            count = self.counts[method] = RpcCount()
        count.calls_total += 1
        if code != "OK":
            count.errors_total += 1
        if self._metrics is not None:
            self._metrics.observe(method, seconds, code)

    def observe_step(self, ops: int, keys: int) -> None:
        if self._metrics is not None:
            self._metrics.observe_step(ops, keys)

    def observe_transfer(self, load_sizes: Sequence[int], store_sizes: Sequence[int]) -> None:
        if self._metrics is not None:
            self._metrics.observe_transfer(load_sizes, store_sizes)

    def run(self, method: str, handle: Callable[[], T]) -> Outcome:
        """Run one call (or one message of a stream), timed and recorded."""
        start = time.perf_counter()
        try:
            outcome = Outcome(handle())
        except KvdError as exc:
            outcome = Outcome(None, exc.code, exc.message)
        except Exception:
            log.exception("%s failed", method)
            outcome = Outcome(None, "INTERNAL", "internal error (see the daemon's log)")
        self.record(method, time.perf_counter() - start, outcome.code)
        return outcome

    async def unary(self, method: str, context: grpc.aio.ServicerContext,
                    handle: Callable[[], T]) -> T:
        """A unary call: its response, or the context aborted with the failure's status."""
        outcome = self.run(method, handle)
        if not outcome.ok:
            await context.abort(grpc_status(outcome.code), outcome.message)
        return outcome.response  # type: ignore[return-value]


def _is_server_stopping(exc: BaseException) -> bool:
    # grpc.aio raises this private type into a stream's reader when the server stops.
    return type(exc).__name__ == "_ServerStoppedError"


# --- engine service ------------------------------------------------------------------------


def _unary_rpc(method: str, kind: str) -> Callable[..., Awaitable[object]]:
    """The unary RPC `method` of KvdEngine: the per-op handler `kind` for the caller's session
    (the same handler a Step runs for an op of that kind)."""

    async def rpc(self: EngineService, request: Message,
                  context: grpc.aio.ServicerContext) -> object:
        op = self._OPS[kind]

        def handle() -> object:
            _check_size(request)
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
        token = _metadata(context, SESSION_TOKEN_METADATA)
        if not token:
            raise Unauthenticated(f"missing session token (metadata {SESSION_TOKEN_METADATA}); "
                                  "attach first")
        return self._core.authenticate(token)

    # -- per-operation handlers shared by the unary RPCs and Step

    def _lookup(self, s: Session, req: kvd_pb2.LookupRequest) -> kvd_pb2.LookupResponse:
        keys = _check_keys(req.keys)
        req_id = _check_str(req.req_id, "req_id")
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
        keys = _check_keys(req.keys)
        req_id = _check_str(req.req_id, "req_id")
        positions = _check_positions(req.positions, len(keys))
        answer = self._callpath.prepare_load(s, keys, req_id, positions)
        return kvd_pb2.PrepareLoadResponse(slot_offsets=answer.offsets, epoch=answer.epoch)

    def _complete_load(self, s: Session,
                       req: kvd_pb2.CompleteLoadRequest) -> kvd_pb2.CompleteLoadResponse:
        keys = _check_keys(req.keys)
        req_id = _check_str(req.req_id, "req_id")
        ignored = self._completions.complete_load(s, keys, req_id, req.epoch)
        return kvd_pb2.CompleteLoadResponse(ignored=ignored)

    def _touch(self, s: Session, req: kvd_pb2.TouchRequest) -> kvd_pb2.TouchResponse:
        keys = _check_keys(req.keys)
        self._core.touch(s, keys, _check_str(req.req_id, "req_id"))
        return kvd_pb2.TouchResponse()

    def _prepare_store(self, s: Session,
                       req: kvd_pb2.PrepareStoreRequest) -> kvd_pb2.PrepareStoreResponse:
        keys = _check_keys(req.keys)
        req_id = _check_str(req.req_id, "req_id")
        positions = _check_positions(req.positions, len(keys))
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
        keys = _check_keys(req.keys)
        req_id = _check_str(req.req_id, "req_id")
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
        self._core.request_finished(s, _check_str(req.req_id, "req_id"))
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
        pins, slots = self._core.release_held(s, _check_str(req.session_id, "session_id"))
        return kvd_pb2.ReleaseHeldResponse(released_pins=pins, released_slots=slots)

    def _grant(self, s: Session, req: kvd_pb2.GrantRequest) -> kvd_pb2.GrantResponse:
        if req.count > MAX_GRANTED_SLOTS:
            raise InvalidArgument(f"count {req.count} is more than MAX_GRANTED_SLOTS "
                                  f"({MAX_GRANTED_SLOTS})")
        return kvd_pb2.GrantResponse(slot_offsets=self._fastpath.grant(s, req.count,
                                                                           req.evict))

    def _store_granted(self, s: Session, req: kvd_pb2.StoreGrantedRequest
                       ) -> kvd_pb2.StoreGrantedResponse:
        keys = _check_keys(req.keys)
        granted = _check_keys(req.granted_keys, "granted_keys")
        if len(req.granted_offsets) != len(granted):
            raise InvalidArgument(f"granted_offsets has {len(req.granted_offsets)} entries for "
                                  f"{len(granted)} granted_keys (one per key)")
        positions = _check_positions(req.positions, len(keys))
        answer = self._fastpath.store_granted(s, keys, _check_str(req.req_id, "req_id"), positions,
                                          granted, list(req.granted_offsets))
        return kvd_pb2.StoreGrantedResponse(
            accepted=answer.accepted, duplicates=answer.duplicates, refused=answer.refused,
            evicted_keys=answer.evicted, epoch=answer.epoch)

    def _pin(self, s: Session, req: kvd_pb2.PinRequest) -> kvd_pb2.PinResponse:
        keys = _check_keys(req.keys)
        if len(req.slot_offsets) != len(keys):
            raise InvalidArgument(f"slot_offsets has {len(req.slot_offsets)} entries for "
                                  f"{len(keys)} keys (one per key)")
        positions = _check_positions(req.positions, len(keys))
        pinned, epoch = self._fastpath.pin_loads(s, keys, list(req.slot_offsets),
                                             _check_str(req.req_id, "req_id"), positions)
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
    }

    # -- RPCs

    def _register(self, context: grpc.aio.ServicerContext,
                  request: kvd_pb2.RegisterSessionRequest) -> kvd_pb2.RegisterSessionResponse:
        _check_size(request)
        s = self._session(context)
        e, lay = request.engine, request.layout
        for name in ("engine_id", "engine_kind", "engine_version", "hostname"):
            _check_str(getattr(e, name), f"engine.{name}", identity=True)
        model = _check_str(request.model, "model", required=True, identity=True)
        salt = _check_str(request.layout_salt, "layout_salt", identity=True)
        _check_str(lay.dtype, "layout.dtype", identity=True)
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

    def _run_step(self, s: Session, request: kvd_pb2.StepRequest) -> kvd_pb2.StepResponse:
        """One step for Step and StepStream: bounds first, then the ops in order."""
        _check_size(request)
        ops = request.ops
        if len(ops) > MAX_OPS_PER_STEP:
            raise InvalidArgument(f"step has {len(ops)} ops, more than MAX_OPS_PER_STEP "
                                  f"({MAX_OPS_PER_STEP})")
        total = 0
        for i, op in enumerate(ops):
            if op.WhichOneof("op") is None:
                raise InvalidArgument(f"op #{i} carries no operation")
            total += _op_keys(op)
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
        token = _metadata(context, SESSION_TOKEN_METADATA) or ""
        requests = aiter(request_iterator)
        while True:
            try:
                request = await anext(requests)
            except StopAsyncIteration:
                return
            except Exception as exc:
                if _is_server_stopping(exc):
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
        token = _metadata(context, SESSION_TOKEN_METADATA)
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
            if _is_server_stopping(exc):
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


class AdminService(kvd_pb2_grpc.KvdAdminServicer):
    """kvd.v1.KvdAdmin, for operators and the `kvd` CLI.

    Authorisation (docs/reliability.md, "Security"): engine session tokens are refused on every
    admin call. On the Unix socket, Stats, ListSessions and GetConfig need only access to the
    socket (its mode and its 0750 directory); Reset and Drain need an admin token as
    `kvd-admin-token` metadata, issued on the attach socket to admin peers (SO_PEERCRED) or read
    from `server.admin_token_file`. On the TLS TCP listener (`remote`) every call needs it.
    """

    def __init__(self, core: KvdCore, config: Config, rpc: RpcRecorder,
                 snapshot: Callable[[], StatsSnapshot],
                 drain: Callable[[float, asyncio.Future[None]], bool], tokens: AdminTokens, *,
                 remote: bool = False) -> None:
        self._core = core
        self._config = config
        self._rpc = rpc
        self._snapshot = snapshot
        self._drain = drain
        self._tokens = tokens
        self._remote = remote

    def _check_admin(self, context: grpc.aio.ServicerContext, *, write: bool = False) -> None:
        if _metadata(context, SESSION_TOKEN_METADATA) is not None:
            raise PermissionDenied("admin calls are refused to engine sessions (a session token "
                                   "was presented)")
        if not self._remote and not (context.peer() or "").startswith("unix:"):
            raise PermissionDenied("admin calls are only accepted on the daemon's Unix socket "
                                   "or its TLS admin listener")
        if not (write or self._remote):
            return
        admin_token = _metadata(context, ADMIN_TOKEN_METADATA) or ""
        if not admin_token:
            raise PermissionDenied(f"this call needs an admin token ({ADMIN_TOKEN_METADATA} "
                                   "metadata): `kvd` gets one on the attach socket for root, the "
                                   "daemon's user and server.admin_uids/admin_gids, or pass "
                                   "--admin-token-file")
        if not self._tokens.valid(admin_token):
            raise PermissionDenied("admin token is unknown or expired; ask for a new one")

    def _stats(self, context: grpc.aio.ServicerContext) -> kvd_pb2.StatsResponse:
        self._check_admin(context)
        return kvd_pb2.StatsResponse(json=json.dumps(self._snapshot().to_dict()))

    async def Stats(self, request: kvd_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> kvd_pb2.StatsResponse:
        return await self._rpc.unary("Stats", context, lambda: self._stats(context))

    def _reset(self, context: grpc.aio.ServicerContext,
               request: kvd_pb2.AdminResetRequest) -> kvd_pb2.AdminResetResponse:
        self._check_admin(context, write=True)
        ns = _check_str(request.namespace_id, "namespace_id")
        answer = self._core.admin_reset(ns or None)
        log.info("admin reset of %s: %d blocks dropped over %d namespace(s)",
                 ns or "every namespace", answer.dropped, answer.namespaces)
        return kvd_pb2.AdminResetResponse(dropped_blocks=answer.dropped,
                                          namespaces=answer.namespaces)

    async def Reset(self, request: kvd_pb2.AdminResetRequest,
                    context: grpc.aio.ServicerContext) -> kvd_pb2.AdminResetResponse:
        return await self._rpc.unary("AdminReset", context, lambda: self._reset(context, request))

    def _drain_call(self, context: grpc.aio.ServicerContext, request: kvd_pb2.DrainRequest,
                    answered: asyncio.Future[None]) -> kvd_pb2.DrainResponse:
        self._check_admin(context, write=True)
        timeout = (request.timeout_ms / 1000 if request.timeout_ms
                   else self._config.server.drain_timeout)
        return kvd_pb2.DrainResponse(started=self._drain(timeout, answered))

    async def Drain(self, request: kvd_pb2.DrainRequest,
                    context: grpc.aio.ServicerContext) -> kvd_pb2.DrainResponse:
        # The daemon shuts down only once this answer is written: a drain with nothing in
        # flight is over at once, and a shutdown then would cut the caller's answer off.
        answered = _call_done(context)
        return await self._rpc.unary("Drain", context,
                                     lambda: self._drain_call(context, request, answered))

    def _sessions(self, context: grpc.aio.ServicerContext,
                  request: kvd_pb2.ListSessionsRequest) -> kvd_pb2.ListSessionsResponse:
        self._check_admin(context)
        if request.limit > MAX_SESSIONS_LIMIT:
            raise InvalidArgument(f"limit {request.limit} is more than {MAX_SESSIONS_LIMIT}")
        listed = self._core.session_list(request.limit or DEFAULT_SESSIONS_LIMIT)
        return kvd_pb2.ListSessionsResponse(sessions=[_session_info(v) for v in listed.sessions],
                                            total=listed.total,
                                            reclaim_holders=self._reclaim_holders())

    def _reclaim_holders(self) -> list[kvd_pb2.ReclaimHolder]:
        """Per namespace, the reader holding back its freed slots' reuse (one a namespace, so
        bounded by MAX_NAMESPACES): an idle reader stalls every writer of its namespace."""
        out = []
        for ns in self._core.namespaces:
            h = ns.reclaim.holder() if ns.reclaim is not None else None
            if h is not None:
                out.append(kvd_pb2.ReclaimHolder(
                    namespace_id=ns.id, session_id=h.session_id, pid=h.pid, live=h.live,
                    held_seconds=h.held_seconds, published_epoch=h.published_epoch,
                    waiting_epoch=h.waiting_epoch, slots_waiting=h.slots_waiting))
        return out

    async def ListSessions(self, request: kvd_pb2.ListSessionsRequest,
                           context: grpc.aio.ServicerContext) -> kvd_pb2.ListSessionsResponse:
        return await self._rpc.unary("ListSessions", context,
                                     lambda: self._sessions(context, request))

    def _config_call(self, context: grpc.aio.ServicerContext) -> kvd_pb2.GetConfigResponse:
        self._check_admin(context)
        return kvd_pb2.GetConfigResponse(toml=self._config.to_toml(), json=self._config.to_json())

    async def GetConfig(self, request: kvd_pb2.GetConfigRequest,
                        context: grpc.aio.ServicerContext) -> kvd_pb2.GetConfigResponse:
        return await self._rpc.unary("GetConfig", context, lambda: self._config_call(context))


def _call_done(context: grpc.aio.ServicerContext) -> asyncio.Future[None]:
    """A future done when the call has ended: its status written to the connection."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not done.done():
            done.set_result(None)

    def ended(*_: object) -> None:
        with contextlib.suppress(RuntimeError):     # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle)

    context.add_done_callback(ended)
    return done


def _session_info(v: SessionView) -> kvd_pb2.SessionInfo:
    engine = v.engine
    return kvd_pb2.SessionInfo(
        session_id=v.session_id, namespace_id=v.namespace_id, model=v.model,
        tenant=v.tenant, peer_uid=v.peer_uid, peer_gid=v.peer_gid, peer_pid=v.peer_pid,
        pins=v.pins, pending_stores=v.pending_stores, leases=v.leases,
        age_seconds=v.age_seconds, idle_seconds=v.idle_seconds,
        engine=kvd_pb2.EngineIdentity(
            engine_id=engine.engine_id, engine_kind=engine.engine_kind,
            engine_version=engine.engine_version, pid=engine.pid, hostname=engine.hostname))
