"""systemd service notifications (sd_notify) without libsystemd.

Implements the documented `NOTIFY_SOCKET` protocol: newline-separated `KEY=VALUE` assignments
sent as one datagram to the AF_UNIX socket named by `$NOTIFY_SOCKET` (a path, or an abstract
socket when the name starts with `@`). Every helper is a no-op returning False when the daemon
does not run under a `Type=notify` unit, so callers never need to check.
"""

from __future__ import annotations

import array
import logging
import os
import socket

log = logging.getLogger(__name__)

_ENV = "NOTIFY_SOCKET"


def _address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):
        # Abstract namespace: a leading NUL byte instead of '@'.
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    # vsock and other transports are not used by kvd's units.
    log.debug("ignoring unsupported NOTIFY_SOCKET %r", value)
    return None


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1\\nSTATUS=serving") to the service manager, if there is one."""
    address = _address(os.environ.get(_ENV, ""))
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
        return True
    except OSError as exc:
        # Readiness is best effort: a missing manager socket must not stop the daemon.
        log.warning("could not notify systemd at %s: %s", os.environ.get(_ENV), exc)
        return False


def ready(status: str | None = None) -> bool:
    """The daemon serves: `READY=1` (and a status line)."""
    return notify("READY=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))


def status(text: str) -> bool:
    """Free-form status shown by `systemctl status`."""
    return notify(f"STATUS={_one_line(text)}")


def stopping(status: str | None = None) -> bool:
    """The daemon is draining and will exit: `STOPPING=1`."""
    return notify("STOPPING=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))


def extend_timeout(seconds: float, status: str | None = None) -> bool:
    """Ask for `seconds` more before the unit's start (or stop) timeout fires:
    `EXTEND_TIMEOUT_USEC=` (systemd 236+), sent while slow start-up work makes progress."""
    line = f"EXTEND_TIMEOUT_USEC={max(1, round(seconds * 1e6))}"
    return notify(line + (f"\nSTATUS={_one_line(status)}" if status else ""))


def watchdog() -> bool:
    """Keep-alive ping for units with `WatchdogSec=`."""
    return notify("WATCHDOG=1")


def watchdog_interval() -> float | None:
    """Half of the unit's watchdog period in seconds (how often to ping), or None if unset."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


# --- the file-descriptor store (FileDescriptorStoreMax=) ---------------------------------------

LISTEN_FDS_START = 3        # sd_listen_fds(3): the first descriptor passed


def store_fds(name: str, fds: list[int]) -> bool:
    """Hand `fds` to systemd's file-descriptor store under `name` (`FDSTORE=1`): systemd keeps
    them open while the daemon restarts and passes them back to the next one (`listen_fds`).
    False when not under systemd (or the unit has no store: systemd then logs and drops them,
    which the daemon cannot see; the unit must set FileDescriptorStoreMax=)."""
    address = _address(os.environ.get(_ENV, ""))
    if address is None:
        return False
    message = f"FDSTORE=1\nFDNAME={name}".encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                      array.array("i", fds).tobytes())])
        return True
    except OSError as exc:
        log.warning("could not hand %s to systemd's descriptor store: %s", name, exc)
        return False


def remove_fds(name: str) -> bool:
    """Drop every descriptor stored under `name` (`FDSTOREREMOVE=1`)."""
    return notify(f"FDSTOREREMOVE=1\nFDNAME={name}")


def listen_fds() -> dict[str, list[int]]:
    """The descriptors systemd passed to this process (`LISTEN_FDS`, `LISTEN_FDNAMES`), by
    name; empty when none are for this pid. The variables are consumed (not inherited)."""
    pid, count = os.environ.pop("LISTEN_PID", ""), os.environ.pop("LISTEN_FDS", "")
    names = os.environ.pop("LISTEN_FDNAMES", "")
    if not count or pid != str(os.getpid()):
        return {}
    try:
        n = int(count)
    except ValueError:
        return {}
    labels = names.split(":") if names else []
    out: dict[str, list[int]] = {}
    for i in range(n):
        fd = LISTEN_FDS_START + i
        label = labels[i] if i < len(labels) else "unknown"
        os.set_inheritable(fd, False)
        out.setdefault(label, []).append(fd)
    return out
