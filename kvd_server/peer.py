"""Who is at the other end of a Unix socket: the peer's pid, uid and gid as the kernel says.

A leaf module: the attach server reads it off a connection, and the sessions and the core keep
it, without the core importing the attach server.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)
