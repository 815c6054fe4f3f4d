"""kvd.v1.KvdAdmin: the operator's gRPC service (stats, sessions, reset, drain, config), behind
the admin token where one is required (kvd_server/rpc/admin_tokens.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import TypeVar

import grpc

from kvd_proto import kvd_pb2, kvd_pb2_grpc
from kvd_proto.wire import (
    ADMIN_TOKEN_METADATA,
    DEFAULT_SESSIONS_LIMIT,
    MAX_SESSIONS_LIMIT,
    SESSION_TOKEN_METADATA,
    TENANT_TOKEN_METADATA,
)
from kvd_server.config import Config
from kvd_server.core.core import KvdCore
from kvd_server.core.sessions import SessionView
from kvd_server.errors import (
    InvalidArgument,
    PermissionDenied,
)
from kvd_server.ops.stats import StatsSnapshot
from kvd_server.rpc.admin_tokens import AdminTokens
from kvd_server.rpc.recorder import RpcRecorder
from kvd_server.rpc.validation import (
    check_keys,
    check_str,
    metadata_value,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


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
        if metadata_value(context, SESSION_TOKEN_METADATA) is not None:
            raise PermissionDenied("admin calls are refused to engine sessions (a session token "
                                   "was presented)")
        if not self._remote and not (context.peer() or "").startswith("unix:"):
            raise PermissionDenied("admin calls are only accepted on the daemon's Unix socket "
                                   "or its TLS admin listener")
        if not (write or self._remote):
            return
        admin_token = metadata_value(context, ADMIN_TOKEN_METADATA) or ""
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
        ns = check_str(request.namespace_id, "namespace_id")
        answer = self._core.admin_reset(ns or None)
        log.info("admin reset of %s: %d blocks dropped over %d namespace(s), %d below the pool",
                 ns or "every namespace", answer.dropped, answer.namespaces, answer.below)
        return kvd_pb2.AdminResetResponse(dropped_blocks=answer.dropped,
                                          namespaces=answer.namespaces,
                                          dropped_below_blocks=answer.below)

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

    # ------------------------------------------------------ agent sessions
    def _tenant_scope(self, context: grpc.aio.ServicerContext, asked: str) -> str | None:
        """The tenant an agent-session call may see: a tenant token's own (whatever was
        asked), or with the admin token `asked` (None: every tenant)."""
        asked = check_str(asked, "tenant")
        token = metadata_value(context, TENANT_TOKEN_METADATA)
        if token and not self._remote:
            if metadata_value(context, SESSION_TOKEN_METADATA) is not None:
                raise PermissionDenied("agent-session calls are refused to engine sessions "
                                       "(a session token was presented)")
            tenant = self._core.retention.tokens.tenant_of(token)
            if tenant is None:
                raise PermissionDenied("tenant token is unknown or expired; ask for a new one "
                                       "on the attach socket (role \"tenant\")")
            return tenant
        if metadata_value(context, ADMIN_TOKEN_METADATA) is None:
            raise PermissionDenied(f"this call needs a tenant token ({TENANT_TOKEN_METADATA}: "
                                   "attach role \"tenant\", what `kvd session` does) or an "
                                   f"admin token ({ADMIN_TOKEN_METADATA})")
        self._check_admin(context, write=True)
        return asked or None

    def _agent_sessions(self, context: grpc.aio.ServicerContext,
                        request: kvd_pb2.ListAgentSessionsRequest
                        ) -> kvd_pb2.ListAgentSessionsResponse:
        tenant = self._tenant_scope(context, request.tenant)
        if request.limit > MAX_SESSIONS_LIMIT:
            raise InvalidArgument(f"limit {request.limit} is more than {MAX_SESSIONS_LIMIT}")
        tag = check_str(request.session, "session")
        rows = self._core.retention.sessions(tenant, tag or None,
                                             request.limit or DEFAULT_SESSIONS_LIMIT)
        return kvd_pb2.ListAgentSessionsResponse(
            tenant=tenant if metadata_value(context, TENANT_TOKEN_METADATA) else "",
            sessions=[kvd_pb2.AgentSessionInfo(
                session=r.tag, tenant=r.tenant, namespace_id=r.namespace_id, model=r.model,
                retained_blocks=r.blocks, retained_bytes=r.bytes,
                expires_in_seconds=r.expires_in, tagged_blocks=r.tagged, below_blocks=r.below)
                for r in rows])

    async def ListAgentSessions(self, request: kvd_pb2.ListAgentSessionsRequest,
                                context: grpc.aio.ServicerContext
                                ) -> kvd_pb2.ListAgentSessionsResponse:
        return await self._rpc.unary("ListAgentSessions", context,
                                     lambda: self._agent_sessions(context, request))

    def _release(self, context: grpc.aio.ServicerContext,
                 request: kvd_pb2.ReleaseAgentSessionRequest
                 ) -> kvd_pb2.ReleaseAgentSessionResponse:
        tenant = self._tenant_scope(context, request.tenant)
        tag = check_str(request.session, "session")
        blocks, spaces = self._core.retention.release(tag, tenant)
        return kvd_pb2.ReleaseAgentSessionResponse(released_blocks=blocks, namespaces=spaces)

    async def ReleaseAgentSession(self, request: kvd_pb2.ReleaseAgentSessionRequest,
                                  context: grpc.aio.ServicerContext
                                  ) -> kvd_pb2.ReleaseAgentSessionResponse:
        return await self._rpc.unary("ReleaseAgentSession", context,
                                     lambda: self._release(context, request))

    def _prewarm(self, context: grpc.aio.ServicerContext,
                 request: kvd_pb2.PrewarmAgentSessionRequest
                 ) -> kvd_pb2.PrewarmAgentSessionResponse:
        tenant = self._tenant_scope(context, request.tenant)
        tag = check_str(request.session, "session")
        keys = check_keys(request.keys)
        if not tag and not keys:
            raise InvalidArgument("name a session, or keys to prewarm")
        retention = self._config.retention
        if request.retain_ms > retention.max_s * 1000:
            raise InvalidArgument(f"retain_ms {request.retain_ms} is more than retention.max_s "
                                  f"({retention.max_s:g} s)")
        if len(tag.encode()) > retention.max_tag_bytes:
            raise InvalidArgument(f"session is longer than retention.max_tag_bytes "
                                  f"({retention.max_tag_bytes})")
        answer = self._core.retention.prewarm(
            tag, tenant, keys, check_str(request.namespace_id, "namespace_id"),
            request.retain_ms / 1000)
        return kvd_pb2.PrewarmAgentSessionResponse(promoting_blocks=answer.promoting,
                                                   in_pool_blocks=answer.in_pool,
                                                   namespaces=answer.namespaces)

    async def PrewarmAgentSession(self, request: kvd_pb2.PrewarmAgentSessionRequest,
                                  context: grpc.aio.ServicerContext
                                  ) -> kvd_pb2.PrewarmAgentSessionResponse:
        return await self._rpc.unary("PrewarmAgentSession", context,
                                     lambda: self._prewarm(context, request))


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
