"""Client side of the attach side channel (docs/attach.md): get the pool fd and a token."""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from dataclasses import dataclass

from .paths import attach_path

PROTOCOL_VERSION = 1
MAX_REPLY_BYTES = 65536


class AttachError(Exception):
    """Attach failed; `code` is a gRPC-style status name, the message says what to do."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True, frozen=True)
class AttachInfo:
    fd: int
    token: str
    session_id: str
    pool_bytes: int
    pool_id: str
    instance_id: str
    slot_alignment: int
    daemon_version: str
    tenant: str


def attach(socket_path: str, *, role: str = "engine", engine_id: str = "",
           timeout: float = 2.0) -> AttachInfo:
    """Attach to the daemon serving `socket_path` (the gRPC socket; `.attach` is derived)."""
    path = attach_path(socket_path)
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    fds: list[int] = []
    try:
        try:
            sock.connect(path)
        except FileNotFoundError:
            raise AttachError("UNAVAILABLE", f"no kvd daemon at {path} (is `kvd serve` running "
                              f"with --socket {socket_path}?)") from None
        except PermissionError:
            raise AttachError("PERMISSION_DENIED", f"permission denied on {path}: this user "
                              f"(uid {os.getuid()}) may not connect; join the daemon's group") \
                from None
        except ConnectionRefusedError:
            raise AttachError("UNAVAILABLE", f"kvd daemon at {path} is not accepting "
                              "connections (stopped or restarting)") from None
        request = {"version": PROTOCOL_VERSION, "pid": os.getpid(), "engine_id": engine_id,
                   "role": role}
        sock.sendall(json.dumps(request).encode() + b"\n")
        header, fds = _recv_exact(sock, 4, deadline, want_fds=True)
        (length,) = struct.unpack(">I", header)
        if length > MAX_REPLY_BYTES:
            raise AttachError("INTERNAL", f"attach reply of {length} bytes is too large")
        body, more = _recv_exact(sock, length, deadline, want_fds=True)
        fds += more
        doc = json.loads(body)
        if not doc.get("ok"):
            raise AttachError(str(doc.get("code", "UNKNOWN")),
                              f"kvd refused the attach: {doc.get('error', 'no reason given')}")
        if len(fds) != 1:
            raise AttachError("INTERNAL", f"attach reply carried {len(fds)} descriptors, not 1")
        fd = fds.pop()
        return AttachInfo(fd=fd, token=doc.get("token", ""),
                          session_id=doc.get("session_id", ""),
                          pool_bytes=int(doc["pool_bytes"]), pool_id=str(doc.get("pool_id", "")),
                          instance_id=str(doc.get("instance_id", "")),
                          slot_alignment=int(doc.get("slot_alignment", 4096)),
                          daemon_version=str(doc.get("daemon_version", "")),
                          tenant=str(doc.get("tenant", "")))
    except TimeoutError:
        raise AttachError("DEADLINE_EXCEEDED",
                          f"kvd daemon at {path} did not answer within {timeout:.1f}s") from None
    except (json.JSONDecodeError, KeyError, ValueError) as exc:
        raise AttachError("INTERNAL", f"malformed attach reply: {exc}") from None
    except ConnectionError as exc:
        raise AttachError("UNAVAILABLE", f"attach connection to {path} failed: {exc}") from None
    finally:
        for fd in fds:
            os.close(fd)
        sock.close()


def _recv_exact(sock: socket.socket, n: int, deadline: float,
                want_fds: bool) -> tuple[bytes, list[int]]:
    buf = b""
    fds: list[int] = []
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        sock.settimeout(remaining)
        if want_fds:
            data, got, _, _ = socket.recv_fds(sock, n - len(buf), 4)
            fds += got
        else:
            data = sock.recv(n - len(buf))
        if not data:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("daemon closed the attach connection early")
        buf += data
    return buf, fds
