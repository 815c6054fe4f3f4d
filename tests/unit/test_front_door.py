"""The front door's graceful close: what the backend (gRPC) wrote reaches the client, and the
client may still write (a settings or ping ack) until it has read the end, never EPIPE.

A door that closed the client's end when gRPC's closed cut `kvd drain`'s answer off now and
then: the CLI's gRPC wrote an ack after the answer, got EPIPE and failed the call before it
had read the answer ("Stream removed (sendmsg: Broken pipe)")."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

from kvd_server.rpc.front_door import FrontDoor

LINGER_S = 5.0


async def _echo_then_bye(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The backend: echoes, and at end of file says "bye" and closes (as gRPC closes its end
    after what it has written)."""
    while data := await reader.read(4096):
        writer.write(data)
    writer.write(b"bye")
    await writer.drain()
    writer.close()


def _client(path: str) -> tuple[bytes, bytes]:
    """Say hello, read the echo, then (the door closing meanwhile) read up to "bye", write an
    ack after it and read the end: (all read after the echo, what the last read gave)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(b"hello")
        assert sock.recv(5) == b"hello"
        got = b""
        while not got.endswith(b"bye"):
            chunk = sock.recv(4096)
            assert chunk, f"end of file before the backend's last words: {got!r}"
            got += chunk
        time.sleep(0.05)           # the door has handled gRPC's close by now
        sock.sendall(b"ack")       # EPIPE here was the bug
        return got, sock.recv(4096)


async def _open_door(tmp_path: Path, per_uid: int) -> tuple[asyncio.Server, FrontDoor]:
    """An echoing backend behind a started front door (its socket door.sock in `tmp_path`)."""
    backend_path = str(tmp_path / "backend.sock")
    backend = await asyncio.start_unix_server(_echo_then_bye, backend_path)
    door = FrontDoor(str(tmp_path / "door.sock"), 0o600, backend_path, per_uid=per_uid,
                     idle_timeout=60)
    await door.start()
    return backend, door


async def _close_while_a_client_talks(tmp_path: Path) -> tuple[tuple[bytes, bytes], float]:
    backend, door = await _open_door(tmp_path, per_uid=8)
    try:
        client = asyncio.get_running_loop().run_in_executor(None, _client, door.path)
        for _ in range(500):                   # the client has been piped and echoed
            if door.connections and all(c.spoke for c in door._conns):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await door.close(linger=LINGER_S)
        took = time.monotonic() - t0
        return await client, took
    finally:
        backend.close()
        await backend.wait_closed()


def test_the_client_reads_the_backends_last_words_and_may_still_write(tmp_path):
    (got, last), took = asyncio.run(_close_while_a_client_talks(tmp_path))
    assert got == b"bye"
    assert last == b""                        # the end, after the client's ack went through
    assert took < LINGER_S                    # the door closed when the client did


async def _a_client_that_never_closes(tmp_path: Path) -> tuple[float, int]:
    backend, door = await _open_door(tmp_path, per_uid=8)
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, door.path)
        await loop.sock_sendall(sock, b"hello")
        assert await loop.sock_recv(sock, 5) == b"hello"
        t0 = time.monotonic()
        await door.close(linger=0.3)
        return time.monotonic() - t0, door.connections
    finally:
        sock.close()
        backend.close()
        await backend.wait_closed()


def test_a_client_that_never_closes_is_closed_after_the_linger(tmp_path):
    took, left = asyncio.run(_a_client_that_never_closes(tmp_path))
    assert 0.3 <= took < 3.0
    assert left == 0


async def _two_connections_of_one_uid(tmp_path: Path) -> tuple[int, bool, int, int]:
    backend, door = await _open_door(tmp_path, per_uid=1)
    loop = asyncio.get_running_loop()
    first, second = (socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2))
    try:
        for sock in (first, second):
            sock.setblocking(False)
            await loop.sock_connect(sock, door.path)
        await loop.sock_sendall(first, b"hello")
        assert await loop.sock_recv(first, 5) == b"hello"
        assert await asyncio.wait_for(loop.sock_recv(second, 5), 5) == b""   # closed at once
        shed = door.shed()                  # as at the descriptor limit: the idlest goes
        return door.refused_total, shed, door.shed_total, door.connections
    finally:
        first.close()
        second.close()
        await door.close(linger=0.1)
        backend.close()
        await backend.wait_closed()


def test_refused_and_shed_connections_are_counted(tmp_path):
    """`kvd stats` (connections) and /metrics show these counts."""
    refused, shed, shed_total, left = asyncio.run(_two_connections_of_one_uid(tmp_path))
    assert refused == 1 and shed and shed_total == 1 and left == 0
