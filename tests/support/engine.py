"""An engine session driven the way an engine does it, on raw KvdEngine stubs: attach (pool fd
and token), map the pool, register, keep a heartbeat stream, and store and load blocks whose
bytes follow from their keys (`block_bytes_of`), so any process can check what another wrote."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from kvd_proto import kvd_pb2, kvd_pb2_grpc
from tests.support.daemon import target
from tests.support.heartbeat import keep_alive

BLOCK = 64 * 1024
TOKEN = "kvd-session-token"


def block_bytes_of(key: bytes, size: int = BLOCK) -> bytes:
    """The deterministic content a test writes for `key`."""
    digest = hashlib.sha256(key).digest()
    return (digest * (size // len(digest) + 1))[:size]


def keys_for(seed: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest()[:16] + i.to_bytes(4, "big")
            for i in range(n)]


def attach(socket: str, engine_id: str = "test") -> Any:
    """Attach as an engine through kvd_client: the pool fd, the token and the pool's facts."""
    from kvd_client.attach import attach as client_attach

    return client_attach(socket, engine_id=engine_id, timeout=5.0)


def map_pool(fd: int, size: int) -> Any:
    """Map the pool shared, as the engine's data plane does (the mapping owns the fd)."""
    from kvd_client.pool_map import PoolMapping

    return PoolMapping(fd, size)


class Engine:
    """One engine session driven with raw KvdEngine stubs (no KvdClient conveniences)."""

    def __init__(self, socket: str, model: str = "test-model", block: int = BLOCK,
                 engine_id: str = "test", register: bool = True,
                 heartbeat: bool = True) -> None:
        self.info = attach(socket, engine_id)
        self.token, self.pool_bytes = self.info.token, self.info.pool_bytes
        self.pool = map_pool(self.info.fd, self.pool_bytes)
        self.channel = grpc.insecure_channel(target(socket))
        self.stub = kvd_pb2_grpc.KvdEngineStub(self.channel)
        self.md = ((TOKEN, self.token),)
        self.block = block
        self.reg: kvd_pb2.RegisterSessionResponse | None = None
        self.notices: list[kvd_pb2.SessionNotice] = []
        self._stop = threading.Event()
        self._stream: threading.Thread | None = None
        if register:
            self.register(model)
        if heartbeat:
            self._stream = threading.Thread(target=self._heartbeat, daemon=True)
            self._stream.start()

    def _heartbeat(self) -> None:
        """Keep the session alive the way a client does: a heartbeat stream every 200 ms."""
        keep_alive(self.stub, self.md, self._stop, self.notices.append)

    def call(self, method: str, request: Any, timeout: float = 5.0) -> Any:
        return getattr(self.stub, method)(request, metadata=self.md, timeout=timeout)

    def register(self, model: str) -> kvd_pb2.RegisterSessionResponse:
        layout = kvd_pb2.KvLayout(block_bytes=self.block, num_ranks=1, shard_bytes=self.block,
                                  tokens_per_block=16, dtype="bfloat16")
        self.reg = self.call("RegisterSession", kvd_pb2.RegisterSessionRequest(
            engine=kvd_pb2.EngineIdentity(engine_id="test", engine_kind="pytest", pid=os.getpid()),
            model=model, layout=layout))
        return self.reg

    def lookup(self, keys: Sequence[bytes], lease_ms: int = 0) -> kvd_pb2.LookupResponse:
        return self.call("Lookup", kvd_pb2.LookupRequest(keys=keys, lease_ms=lease_ms))

    def store(self, keys: Sequence[bytes], complete: bool = True) -> kvd_pb2.PrepareStoreResponse:
        """Reserve, write each key's bytes into its slot, and (optionally) complete."""
        grant = self.call("PrepareStore", kvd_pb2.PrepareStoreRequest(keys=keys, req_id="r"))
        for key, offset in zip(grant.keys_to_store, grant.slot_offsets, strict=True):
            self.write(offset, block_bytes_of(key, self.block))
        if complete and grant.keys_to_store:
            self.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
                keys=grant.keys_to_store, success=True, req_id="r", epoch=grant.epoch,
                slot_offsets=grant.slot_offsets))
        return grant

    def load(self, keys: Sequence[bytes]) -> list[bytes]:
        """Pin, read each key's slot, unpin."""
        out = self.call("PrepareLoad", kvd_pb2.PrepareLoadRequest(keys=keys, req_id="r"))
        data = [self.read(offset) for offset in out.slot_offsets]
        self.call("CompleteLoad", kvd_pb2.CompleteLoadRequest(keys=keys, req_id="r",
                                                              epoch=out.epoch))
        return data

    def write(self, offset: int, data: bytes) -> None:
        view = self.pool.view(offset, len(data))
        view[:] = data
        view.release()

    def read(self, offset: int) -> bytes:
        view = self.pool.view(offset, self.block)
        data = bytes(view)
        view.release()
        return data

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(grpc.RpcError):
            self.call("CloseSession", kvd_pb2.CloseSessionRequest(), timeout=2)
        if self._stream is not None:
            self._stream.join(timeout=5)
        self.channel.close()
        self.pool.close()
