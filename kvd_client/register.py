"""Setting up an engine's session: attach, map the pool, open the gRPC channel, RegisterSession
(with the layout check); then the session's own descriptors from the attach socket.

Apart from `KvdClient` so that the one multi-step set-up, and the undoing of every step taken
when a later one fails, reads in one place; the client only adopts a `Registration` under its
lock, or backs off on `RegisterFailed`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import grpc

from kvd_client.attach import AttachError, attach
from kvd_client.pool_map import PoolMapping
from kvd_proto import kvd_pb2, kvd_pb2_grpc
from kvd_proto.attach import ROLE_ENGINE, AttachRequest, exchange
from kvd_proto.paths import closed_directory, grpc_target
from kvd_proto.wire import SESSION_TOKEN_METADATA, KvLayout, align_up, channel_options

MIN_HEARTBEAT_S = 0.05   # floor on the heartbeat interval a daemon tells


class RegisterFailed(Exception):
    """No session: the reason, prefixed by the step that failed (`attach:` or `register:`).
    Whatever the earlier steps made is already undone."""


@dataclass(slots=True)
class Registration:
    """A registered session: the handles it owns (channel, pool mapping) and what the daemon
    answered. The caller owns it, and closes `channel` and `pool` when done."""
    channel: grpc.Channel
    stub: kvd_pb2_grpc.KvdEngineStub
    metadata: tuple[tuple[str, str], ...]   # the session token, on every call
    pool: PoolMapping
    pool_id: str
    pool_bytes: int
    instance_id: str
    session_id: str
    namespace_id: str
    epoch: int
    slot_bytes: int
    heartbeat_interval_s: float


def register(socket_path: str, *, engine: kvd_pb2.EngineIdentity, model: str, layout: KvLayout,
             salt: str, timeout: float) -> Registration:
    """Attach, map the pool and register a session, each within `timeout`. Raises
    RegisterFailed (a refusal, an unreachable daemon, slots that are not this layout's)."""
    try:
        info = attach(socket_path, role=ROLE_ENGINE, engine_id=engine.engine_id, timeout=timeout)
    except AttachError as exc:
        closed = _closed_directory(socket_path) \
            if exc.code in ("PERMISSION_DENIED", "UNAVAILABLE") else None
        raise RegisterFailed(f"attach: {closed or exc.message}") from None
    pool: PoolMapping | None = None
    channel: grpc.Channel | None = None
    md = ((SESSION_TOKEN_METADATA, info.token),)
    stub: kvd_pb2_grpc.KvdEngineStub | None = None
    try:
        pool = PoolMapping(info.fd, info.pool_bytes)
        channel = grpc.insecure_channel(grpc_target(socket_path),
                                        options=[*channel_options(), ("grpc.enable_retries", 0)])
        stub = kvd_pb2_grpc.KvdEngineStub(channel)
        reg = stub.RegisterSession(kvd_pb2.RegisterSessionRequest(
            engine=engine, model=model, layout_salt=salt,
            layout=kvd_pb2.KvLayout(block_bytes=layout.block_bytes, num_ranks=layout.num_ranks,
                                    shard_bytes=layout.shard_bytes,
                                    tokens_per_block=layout.tokens_per_block,
                                    dtype=layout.dtype, max_key_bytes=layout.max_key_bytes)),
            timeout=timeout, metadata=md)
        expected = align_up(layout.block_bytes, info.slot_alignment)
        if reg.slot_bytes != expected:
            # A daemon (or namespace) whose slots are not this engine's blocks: writing
            # into them would spill into a neighbour's slot or leave bytes unwritten.
            raise ValueError(f"the daemon's slots are {reg.slot_bytes} bytes, this engine's "
                             f"blocks need {expected} ({layout.block_bytes} rounded up to "
                             f"{info.slot_alignment}); refusing to offload")
    except (grpc.RpcError, OSError, ValueError) as exc:
        if pool is not None:
            pool.close()
        if stub is not None:
            # The attach made a session: end it now, or each refused try would hold one
            # of this uid's sessions until the daemon's register timeout.
            with contextlib.suppress(grpc.RpcError):
                stub.CloseSession(kvd_pb2.CloseSessionRequest(), timeout=timeout, metadata=md)
        if channel is not None:
            channel.close()
        detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
        raise RegisterFailed(f"register: {detail}") from None
    return Registration(
        channel=channel, stub=stub, metadata=md, pool=pool, pool_id=info.pool_id,
        pool_bytes=info.pool_bytes, instance_id=info.instance_id, session_id=reg.session_id,
        namespace_id=reg.namespace_id, epoch=reg.epoch, slot_bytes=reg.slot_bytes,
        heartbeat_interval_s=max(reg.heartbeat_interval_ms / 1000.0, MIN_HEARTBEAT_S))


def session_fds(socket_path: str, role: str, token: str, timeout: float, count: int = 2
                ) -> tuple[int, ...] | None:
    """The `count` descriptors a registered session asks for on the attach socket (`role`:
    index, channel or below), or None when the daemon handed over another count (those
    closed). Raises AttachError."""
    _, fds = exchange(socket_path, AttachRequest(role, token=token), timeout)
    if len(fds) != count:
        for fd in fds:
            os.close(fd)
        return None
    return tuple(fds)


def _closed_directory(path: str) -> str | None:
    """When a directory on the way to the daemon's socket refuses this user, which and why."""
    closed = closed_directory(path, "run the engine as its owner or a member of group {group}")
    return None if closed is None else f"permission denied: {closed}"
