"""Pool, extents and the attach side channel (real memfd, real sockets, real fd passing)."""

from __future__ import annotations

import asyncio
import os
import socket
import struct

import pytest

from kvd_client.attach import AttachError, attach
from kvd_client.pool_map import PoolMapping
from kvd_server.attach.server import AttachReply, AttachServer
from kvd_server.errors import PermissionDenied
from kvd_server.memory.extents import ExtentAllocator, NamespaceSlots
from kvd_server.memory.pool import HostPool, PoolError


def test_memfd_pool_prefault_progress():
    pool = HostPool.create(8 << 20)
    seen = []
    pool.prefault(lambda done, total: seen.append((done, total)))
    assert seen[-1] == (8 << 20, 8 << 20)
    assert pool.prefaulted_bytes == 8 << 20
    pool.close()


def test_file_pool_persist_keeps_id(tmp_path):
    a = HostPool.create(1 << 20, "file", str(tmp_path), persist=True)
    pid = a.pool_id
    a.close()
    assert (tmp_path / "kvd-pool").exists()
    b = HostPool.create(1 << 20, "file", str(tmp_path), persist=True)
    assert b.pool_id == pid
    b.close()
    c = HostPool.create(1 << 20, "file", str(tmp_path), persist=False)
    c.close()
    assert not (tmp_path / "kvd-pool").exists()


def test_pool_errors(tmp_path):
    with pytest.raises(PoolError, match="positive"):
        HostPool.create(0)
    with pytest.raises(PoolError, match="does not exist"):
        HostPool.create(1 << 20, "file", str(tmp_path / "missing"))
    with pytest.raises(PoolError, match="unknown pool backing"):
        HostPool.create(1 << 20, "tape")


def test_extents_and_slots_order_and_offsets():
    ext = ExtentAllocator(4 << 20, 1 << 20)
    assert ext.total == 4
    ns = NamespaceSlots(ext, 300_000)           # stride 303104 -> 3 slots per extent
    assert ns.stride == 303104 and ns.per_extent == 3
    assert ns.capacity() == 12
    assert ns.allocate(4) == [0, 1, 2, 3]       # takes two extents
    assert ns.extents_held() == 2
    assert ns.offset(3) == 1 * (1 << 20)
    assert ns.slot_at(ns.offset(2)) == 2
    assert ns.slot_at(ns.offset(2) + 1) is None
    assert ns.slot_at(3 << 20) is None          # an extent it does not hold
    ns.free(1)
    ns.free(3)
    assert ns.allocate(3) == [4, 5, 3]          # fresh ids of held extents, then LIFO
    other = NamespaceSlots(ext, 1 << 20)
    assert other.capacity() == 2
    with pytest.raises(ValueError, match="does not fit"):
        NamespaceSlots(ext, 2 << 20)
    for s in (0, 2, 3, 4, 5):
        ns.free(s)
    assert ns.release_extents() == 2 and ext.free_extents() == 4


def _run_server(tmp_path, handler):
    path = str(tmp_path / "kvd.sock.attach")
    server = AttachServer(path, 0o660, handler)
    return path, server


def test_attach_passes_the_pool_fd(tmp_path):
    pool = HostPool.create(1 << 20)

    def handler(peer, request):
        assert peer.pid == os.getpid() and peer.uid == os.getuid()
        return AttachReply({"token": "t" * 64, "session_id": "s1", "pool_bytes": pool.size,
                            "pool_id": pool.pool_id, "instance_id": "i"}, pool.fd)

    async def main():
        path, server = _run_server(tmp_path, handler)
        await server.start()
        try:
            info = await asyncio.to_thread(attach, path[: -len(".attach")])
            m = PoolMapping(info.fd, info.pool_bytes)
            pool.view()[100:104] = b"kvd!"
            assert bytes(m.view(100, 4)) == b"kvd!"
            m.view(200, 2)[:] = b"ok"
            assert bytes(pool.view()[200:202]) == b"ok"
            m.close()
            assert info.token == "t" * 64
        finally:
            await server.close()
        assert not os.path.exists(path)

    asyncio.run(main())
    pool.close()


def test_attach_refusals_and_garbage(tmp_path):
    def handler(peer, request):
        raise PermissionDenied(f"uid {peer.uid} is not allowed")

    async def main():
        path, server = _run_server(tmp_path, handler)
        await server.start()
        try:
            with pytest.raises(AttachError) as err:
                await asyncio.to_thread(attach, path[: -len(".attach")])
            assert err.value.code == "PERMISSION_DENIED"

            # a silent client must not block others; garbage gets INVALID_ARGUMENT
            silent = socket.socket(socket.AF_UNIX)
            silent.connect(path)

            def garbage(payload: bytes) -> dict:
                import json
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(3)
                s.connect(path)
                s.sendall(payload)
                n = struct.unpack(">I", s.recv(4))[0]
                doc = json.loads(s.recv(n))
                s.close()
                return doc

            doc = await asyncio.to_thread(garbage, b"not json\n")
            assert doc["code"] == "INVALID_ARGUMENT"
            doc = await asyncio.to_thread(garbage, b"x" * 5000 + b"\n")
            assert doc["code"] == "INVALID_ARGUMENT" and "longer" in doc["error"]
            doc = await asyncio.to_thread(garbage, b'{"version": 9}\n')
            assert "version" in doc["error"]
            silent.close()
        finally:
            await server.close()

    asyncio.run(main())


def test_attach_missing_socket(tmp_path):
    with pytest.raises(AttachError, match="is `kvd serve` running"):
        attach(str(tmp_path / "nope.sock"))
