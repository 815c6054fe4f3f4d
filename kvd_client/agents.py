"""An agent harness's handle on its agent sessions (docs/agents.md): list, release, prewarm.

The requests carry the hints (vLLM: `kv_transfer_params`); the harness, which knows when an
agent pauses, resumes and ends, tells the daemon the rest. `AgentSessions` talks to the
daemon's admin service with a tenant token from its attach socket, so it sees and changes only
the calling process's own tenant's sessions (the daemon decides the tenant from the kernel's
peer credentials). The token is asked for again when it expires. Every call has a deadline; a
failure raises `AgentSessionsError` with the daemon's status and message. Not for the engine's
scheduler thread: each call is a round trip to the daemon.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvd_proto import kvd_pb2, kvd_pb2_grpc
from kvd_proto.attach import AttachError, request_tenant_token
from kvd_proto.paths import default_socket_path, grpc_target
from kvd_proto.wire import TENANT_TOKEN_METADATA

DEFAULT_TIMEOUT_S = 5.0


class AgentSessionsError(Exception):
    """A call the daemon refused or did not answer: `code` is the gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(slots=True, frozen=True)
class AgentSession:
    """One agent session's blocks in one namespace."""

    session: str
    namespace_id: str
    model: str
    retained_blocks: int
    retained_bytes: int
    expires_in_seconds: float
    tagged_blocks: int
    below_blocks: int


@dataclass(slots=True, frozen=True)
class Prewarmed:
    promoting_blocks: int        # being promoted into the pool, now or as slots come free
    in_pool_blocks: int          # in the pool already (retained again)
    namespaces: int


class AgentSessions:
    """The calling tenant's agent sessions on one daemon (see the module doc)."""

    def __init__(self, socket: str | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.socket = socket or default_socket_path()
        self.timeout = timeout
        self.tenant = ""
        self._token = ""
        self._channel = grpc.insecure_channel(grpc_target(self.socket))
        self._admin = kvd_pb2_grpc.KvdAdminStub(self._channel)

    def __enter__(self) -> AgentSessions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _metadata(self, fresh: bool = False) -> tuple[tuple[str, str], ...]:
        if fresh or not self._token:
            try:
                self._token, self.tenant = request_tenant_token(self.socket, self.timeout)
            except AttachError as exc:
                raise AgentSessionsError(exc.code, str(exc)) from None
        return ((TENANT_TOKEN_METADATA, self._token),)

    def _call(self, method: Any, request: Any) -> Any:
        for fresh in (False, True):
            try:
                return method(request, metadata=self._metadata(fresh), timeout=self.timeout)
            except grpc.RpcError as exc:
                code = exc.code()
                details = exc.details() or ""
                if code == grpc.StatusCode.PERMISSION_DENIED and "expired" in details \
                        and not fresh:
                    continue                  # the token ran out: ask for another, once
                raise AgentSessionsError(code.name, details) from None
        raise AssertionError("unreachable")

    def list(self, session: str = "", limit: int = 0) -> list[AgentSession]:
        """Sessions with blocks (retained, tagged in the pool, or below it), per namespace,
        most retained first; only `session`'s when named."""
        answer = self._call(self._admin.ListAgentSessions,
                            kvd_pb2.ListAgentSessionsRequest(session=session, limit=limit))
        return [AgentSession(s.session, s.namespace_id, s.model, s.retained_blocks,
                             s.retained_bytes, s.expires_in_seconds, s.tagged_blocks,
                             s.below_blocks) for s in answer.sessions]

    def release(self, session: str) -> int:
        """The session is over: its blocks stop being retained at once; how many were."""
        answer = self._call(self._admin.ReleaseAgentSession,
                            kvd_pb2.ReleaseAgentSessionRequest(session=session))
        return int(answer.released_blocks)

    def prewarm(self, session: str = "", keys: Sequence[bytes] = (), *,
                retain_s: float = 0.0, namespace_id: str = "") -> Prewarmed:
        """Before the session's next turn: its blocks below the pool promoted into it, those
        in it retained again, for `retain_s` (0: the daemon's retention.default_s); with
        `keys`, those keys instead."""
        if not 0 <= retain_s * 1000 < 2**32:
            raise ValueError(f"retain_s {retain_s!r} is not a number of seconds from 0 to "
                             f"{(2**32 - 1) // 1000}")
        answer = self._call(self._admin.PrewarmAgentSession,
                            kvd_pb2.PrewarmAgentSessionRequest(
                                session=session, keys=list(keys), namespace_id=namespace_id,
                                retain_ms=round(retain_s * 1000)))
        return Prewarmed(answer.promoting_blocks, answer.in_pool_blocks, answer.namespaces)
