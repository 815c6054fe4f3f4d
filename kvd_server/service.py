"""gRPC servicers for kvd.v1.KvdEngine and kvd.v1.KvdAdmin.

A thin shell around `KvdCore`: check every bound the proto states, turn messages into core
calls and back, and choose the status code of a failure in exactly one place (`_status_of`).
No exception ever leaves a handler as UNKNOWN: unexpected ones are logged once and answered
INTERNAL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvd_proto import kvd_pb2, kvd_pb2_grpc
from kvd_server import __version__
from kvd_server.admin_auth import ADMIN_TOKEN_METADATA, AdminTokens
from kvd_server.config import SLOT_ALIGNMENT, Config
from kvd_server.core import EngineInfo, KvdCore, Layout, TransferStats
from kvd_server.errors import KvdError
from kvd_server.manager.types import ManagerError, NotReadyError

log = logging.getLogger(__name__)

TOKEN_METADATA = "kvd-session-token"
# Bounds stated in proto/kvd/v1/kvd.proto.
MAX_KEYS_PER_CALL = 4096
MAX_KEY_BYTES = 128
MAX_OPS_PER_STEP = 256
MAX_KEYS_PER_STEP = 16384
MAX_STRING_BYTES = 256
DEFAULT_EVENTS = 1024
MAX_EVENTS = 65536
MAX_TRANSFER_SAMPLES = 4096
MAX_BLOCK_BYTES = 1 << 30
MAX_RANKS = 1024
DEFAULT_SESSIONS_LIMIT = 1000
MAX_SESSIONS_LIMIT = 10000

_DAEMON_STATE = {
    "starting": kvd_pb2.DAEMON_STATE_STARTING,
    "serving": kvd_pb2.DAEMON_STATE_SERVING,
    "draining": kvd_pb2.DAEMON_STATE_DRAINING,
}


class RequestError(Exception):
    """A request the service refuses before it reaches the core (bounds, token, permission)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place a failure becomes a gRPC status."""
    if isinstance(exc, (KvdError, RequestError)):
        return exc.code, str(exc)
    if isinstance(exc, NotReadyError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, ManagerError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    return grpc.StatusCode.INTERNAL, "internal error (see the daemon's log)"


@dataclass(slots=True)
class RpcCount:
    calls_total: int = 0
    errors_total: int = 0


# --- validation ----------------------------------------------------------------------------


def _check_keys(keys: Sequence[bytes], field: str = "keys") -> list[bytes]:
    if len(keys) > MAX_KEYS_PER_CALL:
        raise _invalid(f"{field} has {len(keys)} keys, more than MAX_KEYS_PER_CALL "
                       f"({MAX_KEYS_PER_CALL})")
    seen: dict[bytes, int] = {}
    for i, key in enumerate(keys):
        if not key:
            raise _invalid(f"{field}[{i}] is empty (MAX_KEY_BYTES: keys are 1..{MAX_KEY_BYTES} "
                           "bytes)")
        if len(key) > MAX_KEY_BYTES:
            raise _invalid(f"{field}[{i}] has {len(key)} bytes, more than MAX_KEY_BYTES "
                           f"({MAX_KEY_BYTES})")
        first = seen.setdefault(key, i)
        if first != i:
            raise _invalid(f"{field}[{i}] duplicates {field}[{first}] (duplicate keys are not "
                           "allowed within one call)")
    return list(keys)


def _check_str(value: str, field: str, *, required: bool = False) -> str:
    size = len(value.encode())
    if size > MAX_STRING_BYTES:
        raise _invalid(f"{field} has {size} bytes, more than {MAX_STRING_BYTES}")
    if required and not size:
        raise _invalid(f"{field} is required (1..{MAX_STRING_BYTES} bytes)")
    return value


def _check_positions(positions: Sequence[int], n: int) -> list[int] | None:
    if not positions:
        return None
    if len(positions) != n:
        raise _invalid(f"positions has {len(positions)} entries for {n} keys (must be empty "
                       "or one per key)")
    return list(positions)


def _check_samples(samples: Sequence[int], field: str) -> list[int]:
    if len(samples) > MAX_TRANSFER_SAMPLES:
        raise _invalid(f"{field} has {len(samples)} samples, more than {MAX_TRANSFER_SAMPLES}")
    return list(samples)


def _op_keys(op: kvd_pb2.StepOp) -> int:
    kind = op.WhichOneof("op")
    if kind is None:
        return 0
    inner = getattr(op, kind)
    return len(inner.keys) if hasattr(inner, "keys") else 0


# --- engine service ------------------------------------------------------------------------


class EngineService(kvd_pb2_grpc.KvdEngineServicer):
    """kvd.v1.KvdEngine: one engine session per token."""

    def __init__(self, core: KvdCore, config: Config, pool_bytes: int,
                 rpc: RpcRecorder) -> None:
        self._core = core
        self._config = config
        self._pool_bytes = pool_bytes
        self._rpc = rpc
        self.step_calls = 0
        self.step_ops = 0

    # -- session plumbing

    @staticmethod
    def _token(context: grpc.aio.ServicerContext) -> str:
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_METADATA:
                return value if isinstance(value, str) else value.decode(errors="replace")
        return ""

    def _session(self, context: grpc.aio.ServicerContext) -> Any:
        token = self._token(context)
        if not token:
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED,
                               f"missing session token (metadata {TOKEN_METADATA}); attach first")
        return self._core.authenticate(token)

    # -- per-operation handlers shared by the unary RPCs and Step

    def _lookup(self, s: Any, req: kvd_pb2.LookupRequest) -> kvd_pb2.LookupResponse:
        keys = _check_keys(req.keys)
        req_id = _check_str(req.req_id, "req_id")
        answer = self._core.lookup(s, keys, prefix=req.prefix, lease_ms=req.lease_ms,
                                   req_id=req_id)
        states, epoch = answer[0], answer[1]
        out = kvd_pb2.LookupResponse(states=[int(state) for state in states], epoch=epoch)
        if req.lease_ms > 0:
            offsets = answer[2] if len(answer) > 2 else None
            if offsets is None:
                offsets = [0] * len(states)
            out.slot_offsets.extend(int(o) for o in offsets)
        return out

    def _prepare_load(self, s: Any,
                      req: kvd_pb2.PrepareLoadRequest) -> kvd_pb2.PrepareLoadResponse:
        keys = _check_keys(req.keys)
        req_id = _check_str(req.req_id, "req_id")
        positions = _check_positions(req.positions, len(keys))
        offsets, epoch = self._core.prepare_load(s, keys, req_id, positions)
        return kvd_pb2.PrepareLoadResponse(slot_offsets=offsets, epoch=epoch)

    def _complete_load(self, s: Any,
                       req: kvd_pb2.CompleteLoadRequest) -> kvd_pb2.CompleteLoadResponse:
        keys = _check_keys(req.keys)
        req_id = _check_str(req.req_id, "req_id")
        ignored = self._core.complete_load(s, keys, req_id, req.epoch)
        return kvd_pb2.CompleteLoadResponse(ignored=bool(ignored))

    def _touch(self, s: Any, req: kvd_pb2.TouchRequest) -> kvd_pb2.TouchResponse:
        keys = _check_keys(req.keys)
        self._core.touch(s, keys, _check_str(req.req_id, "req_id"))
        return kvd_pb2.TouchResponse()

    def _prepare_store(self, s: Any,
                       req: kvd_pb2.PrepareStoreRequest) -> kvd_pb2.PrepareStoreResponse:
        keys = _check_keys(req.keys)
        req_id = _check_str(req.req_id, "req_id")
        positions = _check_positions(req.positions, len(keys))
        answer, epoch = self._core.prepare_store(s, keys, req_id, positions)
        return kvd_pb2.PrepareStoreResponse(
            cannot_store=answer.cannot_store,
            keys_to_store=answer.keys_to_store,
            slot_offsets=answer.slot_offsets,
            evicted_keys=answer.evicted_keys,
            epoch=epoch,
        )

    def _complete_store(self, s: Any,
                        req: kvd_pb2.CompleteStoreRequest) -> kvd_pb2.CompleteStoreResponse:
        keys = _check_keys(req.keys)
        req_id = _check_str(req.req_id, "req_id")
        offsets: list[int] | None = None
        if req.slot_offsets:
            if len(req.slot_offsets) != len(keys):
                raise _invalid(f"slot_offsets has {len(req.slot_offsets)} entries for "
                               f"{len(keys)} keys (must be empty or one per key)")
            for i, offset in enumerate(req.slot_offsets):
                if offset >= self._pool_bytes or offset % SLOT_ALIGNMENT:
                    raise _invalid(f"slot_offsets[{i}] = {offset} is not a slot offset (outside "
                                   f"the {self._pool_bytes}-byte pool or not {SLOT_ALIGNMENT}-"
                                   "aligned)")
            offsets = list(req.slot_offsets)
        result = self._core.complete_store(s, keys, req.success, req_id, req.epoch, offsets)
        return kvd_pb2.CompleteStoreResponse(ignored=result.ignored, completed=result.completed,
                                             mismatched=result.mismatched)

    def _request_finished(self, s: Any, req: kvd_pb2.RequestFinishedRequest
                          ) -> kvd_pb2.RequestFinishedResponse:
        self._core.request_finished(s, _check_str(req.req_id, "req_id"))
        return kvd_pb2.RequestFinishedResponse()

    def _take_events(self, s: Any, req: kvd_pb2.TakeEventsRequest) -> kvd_pb2.TakeEventsResponse:
        if req.max_events > MAX_EVENTS:
            raise _invalid(f"max_events {req.max_events} is more than {MAX_EVENTS}")
        events, more = self._core.take_events(s, req.max_events or DEFAULT_EVENTS)
        return kvd_pb2.TakeEventsResponse(
            events=[kvd_pb2.OffloadEvent(keys=e.keys, removed=e.removed,
                                         metadata_only=e.metadata_only) for e in events],
            more=more,
        )

    def _reset(self, s: Any, req: kvd_pb2.ResetRequest) -> kvd_pb2.ResetResponse:
        epoch, dropped = self._core.reset_namespace(s)
        return kvd_pb2.ResetResponse(epoch=epoch, dropped_blocks=dropped)

    def _transfer_report(self, s: Any, req: kvd_pb2.TransferReport
                         ) -> kvd_pb2.TransferReportResponse:
        load_sizes = _check_samples(req.load_sizes, "load_sizes")
        store_sizes = _check_samples(req.store_sizes, "store_sizes")
        self._core.transfer_report(s, TransferStats(
            load_bytes=req.load_bytes, load_seconds=req.load_seconds,
            store_bytes=req.store_bytes, store_seconds=req.store_seconds,
            load_sizes=load_sizes, store_sizes=store_sizes,
        ))
        self._rpc.observe_transfer(load_sizes, store_sizes)
        return kvd_pb2.TransferReportResponse()

    _OPS: dict[str, Callable[[EngineService, Any, Any], Any]] = {
        "lookup": _lookup,
        "prepare_load": _prepare_load,
        "complete_load": _complete_load,
        "touch": _touch,
        "prepare_store": _prepare_store,
        "complete_store": _complete_store,
        "request_finished": _request_finished,
        "take_events": _take_events,
        "reset": _reset,
        "transfer_report": _transfer_report,
    }

    # -- RPCs

    async def RegisterSession(self, request: kvd_pb2.RegisterSessionRequest,
                              context: grpc.aio.ServicerContext) -> kvd_pb2.RegisterSessionResponse:
        async def handle() -> kvd_pb2.RegisterSessionResponse:
            s = self._session(context)
            e, lay = request.engine, request.layout
            for name in ("engine_id", "engine_kind", "engine_version", "hostname"):
                _check_str(getattr(e, name), f"engine.{name}")
            model = _check_str(request.model, "model", required=True)
            salt = _check_str(request.layout_salt, "layout_salt")
            _check_str(lay.dtype, "layout.dtype")
            if not 1 <= lay.block_bytes <= MAX_BLOCK_BYTES:
                raise _invalid(f"layout.block_bytes {lay.block_bytes} is out of range "
                               f"1..{MAX_BLOCK_BYTES}")
            if not 1 <= lay.num_ranks <= MAX_RANKS:
                raise _invalid(f"layout.num_ranks {lay.num_ranks} is out of range 1..{MAX_RANKS}")
            if lay.shard_bytes * lay.num_ranks != lay.block_bytes:
                raise _invalid(f"layout.block_bytes ({lay.block_bytes}) must equal num_ranks "
                               f"({lay.num_ranks}) x shard_bytes ({lay.shard_bytes})")
            reg = self._core.register(
                s,
                EngineInfo(engine_id=e.engine_id, engine_kind=e.engine_kind,
                           engine_version=e.engine_version, pid=e.pid, hostname=e.hostname),
                model,
                Layout(block_bytes=lay.block_bytes, num_ranks=lay.num_ranks,
                       shard_bytes=lay.shard_bytes, tokens_per_block=lay.tokens_per_block,
                       dtype=lay.dtype),
                salt,
            )
            m = self._config.manager
            return kvd_pb2.RegisterSessionResponse(
                session_id=reg.session_id, namespace_id=reg.namespace_id, epoch=reg.epoch,
                slot_bytes=reg.slot_bytes, pool_bytes=self._pool_bytes,
                heartbeat_interval_ms=round(m.heartbeat_interval * 1000),
                liveness_timeout_ms=round(m.liveness_timeout * 1000),
                default_lease_ms=round(m.default_lease * 1000),
                daemon_version=__version__, tenant=reg.tenant,
            )

        return await self._rpc.unary("RegisterSession", context, handle)

    def _unary_op(self, method: str, kind: str) -> Callable[[Any, Any], Awaitable[Any]]:
        async def rpc(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async def handle() -> Any:
                return self._OPS[kind](self, self._session(context), request)

            return await self._rpc.unary(method, context, handle)

        return rpc

    async def Lookup(self, request, context):
        return await self._unary_op("Lookup", "lookup")(request, context)

    async def PrepareLoad(self, request, context):
        return await self._unary_op("PrepareLoad", "prepare_load")(request, context)

    async def CompleteLoad(self, request, context):
        return await self._unary_op("CompleteLoad", "complete_load")(request, context)

    async def Touch(self, request, context):
        return await self._unary_op("Touch", "touch")(request, context)

    async def PrepareStore(self, request, context):
        return await self._unary_op("PrepareStore", "prepare_store")(request, context)

    async def CompleteStore(self, request, context):
        return await self._unary_op("CompleteStore", "complete_store")(request, context)

    async def RequestFinished(self, request, context):
        return await self._unary_op("RequestFinished", "request_finished")(request, context)

    async def TakeEvents(self, request, context):
        return await self._unary_op("TakeEvents", "take_events")(request, context)

    async def Reset(self, request, context):
        return await self._unary_op("Reset", "reset")(request, context)

    def _run_step(self, s: Any, request: kvd_pb2.StepRequest) -> kvd_pb2.StepResponse:
        """One step for Step and StepStream: bounds first, then the ops in order."""
        ops = request.ops
        if len(ops) > MAX_OPS_PER_STEP:
            raise _invalid(f"step has {len(ops)} ops, more than MAX_OPS_PER_STEP "
                           f"({MAX_OPS_PER_STEP})")
        total = 0
        for i, op in enumerate(ops):
            if op.WhichOneof("op") is None:
                raise _invalid(f"op #{i} carries no operation")
            total += _op_keys(op)
        if total > MAX_KEYS_PER_STEP:
            raise _invalid(f"step carries {total} keys over its ops, more than "
                           f"MAX_KEYS_PER_STEP ({MAX_KEYS_PER_STEP})")
        self.step_calls += 1
        self.step_ops += len(ops)
        self._rpc.observe_step(len(ops), total)
        out = kvd_pb2.StepResponse()
        epoch = 0
        for i, op in enumerate(ops):
            kind = op.WhichOneof("op")
            try:
                result = self._OPS[kind](self, s, getattr(op, kind))
            except (KvdError, RequestError, ManagerError) as exc:
                code, message = _status_of(exc)
                raise RequestError(code, f"op #{i} ({kind}): {message}") from exc
            epoch = getattr(result, "epoch", epoch) or epoch
            getattr(out.results.add(), kind).CopyFrom(result)
        out.epoch = epoch or self._current_epoch(s)
        return out

    async def Step(self, request: kvd_pb2.StepRequest,
                   context: grpc.aio.ServicerContext) -> kvd_pb2.StepResponse:
        async def handle() -> kvd_pb2.StepResponse:
            return self._run_step(self._session(context), request)

        return await self._rpc.unary("Step", context, handle)

    async def StepStream(self, request_iterator: AsyncIterator[kvd_pb2.StepRequest],
                         context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[kvd_pb2.StepResponse]:
        """Steps on one stream; each is recorded as a `Step` call. Rejections are in-band;
        only a session that is gone ends the stream (UNAUTHENTICATED)."""
        try:
            self._session(context)
        except (KvdError, RequestError) as exc:
            code, message = _status_of(exc)
            self._rpc.record("Step", 0.0, code)
            await context.abort(code, message)
        token = self._token(context)
        requests = aiter(request_iterator)
        while True:
            try:
                request = await anext(requests)
            except StopAsyncIteration:
                return
            except Exception as exc:
                if type(exc).__name__ == "_ServerStoppedError":
                    return  # the daemon is stopping: the stream ends with it
                raise
            start = time.perf_counter()
            try:
                s = self._core.authenticate(token)
            except KvdError as exc:
                code, message = _status_of(exc)
                self._rpc.record("Step", time.perf_counter() - start, code)
                await context.abort(code, message)
            try:
                out = self._run_step(s, request)
                code = grpc.StatusCode.OK
            except Exception as exc:
                code, message = _status_of(exc)
                if code == grpc.StatusCode.INTERNAL:
                    log.exception("Step failed")
                out = kvd_pb2.StepResponse(error_code=code.value[0], error_message=message)
            self._rpc.record("Step", time.perf_counter() - start, code)
            yield out

    def _current_epoch(self, s: Any) -> int:
        epoch = getattr(s, "epoch", 0)
        return int(epoch() if callable(epoch) else epoch or 0)

    async def CloseSession(self, request: kvd_pb2.CloseSessionRequest,
                           context: grpc.aio.ServicerContext) -> kvd_pb2.CloseSessionResponse:
        async def handle() -> kvd_pb2.CloseSessionResponse:
            try:
                s = self._session(context)
            except KvdError as exc:
                if exc.code == grpc.StatusCode.UNAUTHENTICATED:
                    return kvd_pb2.CloseSessionResponse()  # already closed: idempotent
                raise
            self._core.close_session(s, "closed by client")
            return kvd_pb2.CloseSessionResponse()

        return await self._rpc.unary("CloseSession", context, handle)

    async def SessionStream(self, request_iterator: AsyncIterator[kvd_pb2.SessionHeartbeat],
                            context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[kvd_pb2.SessionNotice]:
        """Answer each heartbeat; the stream ending (or the client cancelling) ends the session."""
        method = "SessionStream"
        start = time.perf_counter()
        try:
            s = self._session(context)
        except (KvdError, RequestError) as exc:
            code, message = _status_of(exc)
            self._rpc.record(method, time.perf_counter() - start, code)
            await context.abort(code, message)
        reason = "session stream closed"
        code = grpc.StatusCode.OK
        try:
            async for heartbeat in request_iterator:
                self._core.heartbeat(s)
                yield kvd_pb2.SessionNotice(
                    seq=heartbeat.seq, epoch=self._current_epoch(s),
                    state=_DAEMON_STATE.get(_state_name(self._core.state),
                                            kvd_pb2.DAEMON_STATE_UNSPECIFIED))
        except asyncio.CancelledError:
            reason = "session stream cancelled"
            code = grpc.StatusCode.CANCELLED
            raise
        except (KvdError, RequestError) as exc:
            code, message = _status_of(exc)
            reason = f"session stream failed: {message}"
            await context.abort(code, message)
        except Exception as exc:
            if type(exc).__name__ == "_ServerStoppedError":
                # The daemon is stopping (drain done): streams end with it; not an error.
                reason = "daemon stopped"
                code = grpc.StatusCode.UNAVAILABLE
                return
            log.exception("SessionStream failed")
            code = grpc.StatusCode.INTERNAL
            reason = "session stream failed"
            await context.abort(code, "internal error (see the daemon's log)")
        finally:
            try:
                self._core.close_session(s, reason)
            except KvdError:
                pass  # already closed (CloseSession, sweep): nothing left to release
            except Exception:
                log.exception("closing session after its stream ended failed")
            self._rpc.record(method, time.perf_counter() - start, code)


def _state_name(state: Any) -> str:
    name = getattr(state, "value", state)
    return str(getattr(state, "name", name) if not isinstance(name, str) else name).lower()


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
                 stats: Callable[[], dict[str, Any]],
                 drain: Callable[[float], bool], tokens: AdminTokens, *,
                 remote: bool = False) -> None:
        self._core = core
        self._config = config
        self._rpc = rpc
        self._stats = stats
        self._drain = drain
        self._tokens = tokens
        self._remote = remote

    def _check_admin(self, context: grpc.aio.ServicerContext, *, write: bool = False) -> None:
        admin_token = ""
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_METADATA:
                raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                                   "admin calls are refused to engine sessions (a session token "
                                   "was presented)")
            if key == ADMIN_TOKEN_METADATA:
                admin_token = value if isinstance(value, str) else ""
        if not self._remote and not (context.peer() or "").startswith("unix:"):
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                               "admin calls are only accepted on the daemon's Unix socket or "
                               "its TLS admin listener")
        if not (write or self._remote):
            return
        if not admin_token:
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                               f"this call needs an admin token ({ADMIN_TOKEN_METADATA} "
                               "metadata): `kvd` gets one on the attach socket for root, the "
                               "daemon's user and server.admin_uids/admin_gids, or pass "
                               "--admin-token-file")
        if not self._tokens.valid(admin_token):
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                               "admin token is unknown or expired; ask for a new one")

    async def Stats(self, request, context):
        async def handle():
            self._check_admin(context)
            return kvd_pb2.StatsResponse(json=json.dumps(self._stats()))

        return await self._rpc.unary("Stats", context, handle)

    async def Reset(self, request, context):
        async def handle():
            self._check_admin(context, write=True)
            ns = _check_str(request.namespace_id, "namespace_id")
            dropped, namespaces = self._core.admin_reset(ns or None)
            log.info("admin reset of %s: %d blocks dropped over %d namespace(s)",
                     ns or "every namespace", dropped, namespaces)
            return kvd_pb2.AdminResetResponse(dropped_blocks=dropped, namespaces=namespaces)

        return await self._rpc.unary("AdminReset", context, handle)

    async def Drain(self, request, context):
        async def handle():
            self._check_admin(context, write=True)
            timeout = (request.timeout_ms / 1000 if request.timeout_ms
                       else self._config.server.drain_timeout)
            return kvd_pb2.DrainResponse(started=self._drain(timeout))

        return await self._rpc.unary("Drain", context, handle)

    async def ListSessions(self, request, context):
        async def handle():
            self._check_admin(context)
            if request.limit > MAX_SESSIONS_LIMIT:
                raise _invalid(f"limit {request.limit} is more than {MAX_SESSIONS_LIMIT}")
            views, total = self._core.sessions(request.limit or DEFAULT_SESSIONS_LIMIT)
            return kvd_pb2.ListSessionsResponse(sessions=[_session_info(v) for v in views],
                                                total=total)

        return await self._rpc.unary("ListSessions", context, handle)

    async def GetConfig(self, request, context):
        async def handle():
            self._check_admin(context)
            return kvd_pb2.GetConfigResponse(toml=self._config.to_toml(),
                                             json=self._config.to_json())

        return await self._rpc.unary("GetConfig", context, handle)


def _session_info(v: Any) -> kvd_pb2.SessionInfo:
    engine = v.engine
    info = kvd_pb2.SessionInfo(
        session_id=v.session_id, namespace_id=v.namespace_id or "", model=v.model or "",
        tenant=v.tenant, peer_uid=v.peer_uid, peer_gid=v.peer_gid, peer_pid=v.peer_pid,
        pins=v.pins, pending_stores=v.pending_stores, leases=v.leases,
        age_seconds=v.age_seconds, idle_seconds=v.idle_seconds,
    )
    if engine is not None:
        info.engine.CopyFrom(kvd_pb2.EngineIdentity(
            engine_id=engine.engine_id, engine_kind=engine.engine_kind,
            engine_version=engine.engine_version, pid=engine.pid, hostname=engine.hostname))
    return info


# --- per-call bookkeeping ------------------------------------------------------------------


class RpcRecorder:
    """Counts calls and errors per method (the stats document's `rpc` section) and feeds the
    Prometheus metrics when they are on; runs every handler under the one error mapping."""

    def __init__(self, metrics: Any | None = None) -> None:
        self.counts: dict[str, RpcCount] = {}
        self._metrics = metrics

    def record(self, method: str, seconds: float, code: grpc.StatusCode) -> None:
        count = self.counts.get(method)
        if count is None:
            count = self.counts[method] = RpcCount()
        count.calls_total += 1
        if code != grpc.StatusCode.OK:
            count.errors_total += 1
        if self._metrics is not None:
            self._metrics.observe(method, seconds, code.name)

    def observe_step(self, ops: int, keys: int) -> None:
        if self._metrics is not None:
            self._metrics.observe_step(ops, keys)

    def observe_transfer(self, load_sizes: list[int], store_sizes: list[int]) -> None:
        if self._metrics is not None:
            self._metrics.observe_transfer(load_sizes, store_sizes)

    def section(self) -> dict[str, dict[str, int]]:
        return {m: {"calls_total": c.calls_total, "errors_total": c.errors_total}
                for m, c in sorted(self.counts.items())}

    async def unary(self, method: str, context: grpc.aio.ServicerContext,
                    handle: Callable[[], Awaitable[Any]]) -> Any:
        start = time.perf_counter()
        try:
            response = await handle()
        except asyncio.CancelledError:
            self.record(method, time.perf_counter() - start, grpc.StatusCode.CANCELLED)
            raise
        except Exception as exc:
            code, message = _status_of(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method)
            self.record(method, time.perf_counter() - start, code)
            await context.abort(code, message)
        self.record(method, time.perf_counter() - start, grpc.StatusCode.OK)
        return response
