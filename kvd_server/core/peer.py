"""Who is at the other end of a Unix socket: the peer's pid, uid and gid as the kernel says.

A leaf module: the attach server reads it off a connection, and the sessions and the core keep
it, without the core importing the attach server.
"""

from __future__ import annotations

import os
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


UNSEEN = -1        # process_start: the process exists, but /proc does not show it to us


def process_start(pid: int) -> int:
    """When process `pid` started (clock ticks after boot, /proc/PID/stat's 22nd field): with
    the pid, a process's identity, since a pid alone may name another process once reused.
    0 when there is no such process (a zombie counts as gone: it has no mappings left);
    UNSEEN when it exists but /proc hides it (systemd's ProtectProc=invisible hides other
    users' processes; the kernel still says it exists)."""
    if pid <= 0:
        return 0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return UNSEEN if _exists(pid) else 0
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return 0
    try:
        return int(fields[19])
    except ValueError:
        return UNSEEN


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True             # another user's process: it exists
    return True


def same_process(pid: int, start: int) -> bool:
    """Whether the process that had `pid` when it started at `start` may still run: that
    very process, or one /proc hides from us under that pid (assumed it, to be safe)."""
    if pid <= 0:
        return False
    now = process_start(pid)
    return now == UNSEEN or (now != 0 and now == start)
