"""Where a daemon's sockets are, and whether one answers there: one rule for both sides.

The daemon serves gRPC on a Unix socket `P` and the attach side channel on `P.attach`. With
nothing configured, `P` is `$KVD_SOCKET`, else `$KVD_SERVER_SOCKET`, else
`$XDG_RUNTIME_DIR/kvd/kvd.sock`, else `/tmp/kvd-$UID/kvd.sock` (systemd and Kubernetes set
`/run/kvd/kvd.sock` explicitly). Clients (the CLI, kvd_client) follow the same rule, except that
when neither variable is set and the user's own socket does not exist, they try the system
daemon's `/run/kvd/kvd.sock`; a daemon never binds there unless told to.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import socket
import stat
from collections.abc import Mapping

ATTACH_SUFFIX = ".attach"
LOCK_SUFFIX = ".lock"
SOCKET_ENV = ("KVD_SOCKET", "KVD_SERVER_SOCKET")
SYSTEM_SOCKET = "/run/kvd/kvd.sock"   # what the systemd unit and the DaemonSet configure


def runtime_socket_path(env: Mapping[str, str] | None = None) -> str:
    """`$XDG_RUNTIME_DIR/kvd/kvd.sock` when XDG_RUNTIME_DIR is set, else
    `/tmp/kvd-$UID/kvd.sock`: a user's own daemon, with no environment override."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime:
        return os.path.join(runtime, "kvd", "kvd.sock")
    return f"/tmp/kvd-{os.getuid()}/kvd.sock"


def daemon_socket_path(env: Mapping[str, str] | None = None) -> str:
    """The socket a daemon binds when none is configured: `$KVD_SOCKET`, `$KVD_SERVER_SOCKET`,
    else the runtime rule. A relative path is taken from the current directory."""
    env = os.environ if env is None else env
    for name in SOCKET_ENV:
        if env.get(name):
            return os.path.abspath(env[name])
    return runtime_socket_path(env)


def default_socket_path(env: Mapping[str, str] | None = None) -> str:
    """The socket a client talks to when none is given: the daemon's rule, or the system
    daemon's socket when no variable names one, the user's own socket does not exist and the
    system's does (a node run by systemd or Kubernetes needs no --socket then)."""
    env = os.environ if env is None else env
    path = daemon_socket_path(env)
    if any(env.get(name) for name in SOCKET_ENV) or os.path.lexists(path):
        return path
    return SYSTEM_SOCKET if os.path.lexists(SYSTEM_SOCKET) else path


def attach_path(socket_path: str) -> str:
    """The attach side channel lies beside the gRPC socket."""
    return socket_path + ATTACH_SUFFIX


def socket_lock_path(socket_path: str) -> str:
    """The file a daemon holds locked (flock) for its socket path from before it binds until
    it exits: a second daemon is refused even while the first is starting, and `kvd health
    --wait` tells a daemon still starting from none at all. Beside the sockets."""
    return socket_path + LOCK_SUFFIX


def grpc_target(socket_path: str) -> str:
    """The gRPC target of a Unix socket path (always absolute: `unix:///abs/path`)."""
    return "unix://" + os.path.abspath(socket_path)


class SocketState(enum.Enum):
    """What a connect() to a socket path found."""

    ABSENT = "absent"          # nothing at the path
    NOT_SOCKET = "not_socket"  # a file that is not a socket
    STALE = "stale"            # a socket nobody listens on (a dead daemon's)
    LIVE = "live"              # something accepted the connection
    DENIED = "denied"          # the socket exists but this user may not connect
    ERROR = "error"            # another failure (see the probe's message)


def probe_socket(path: str, timeout: float = 1.0) -> tuple[SocketState, str]:
    """Connect once to `path` and say what answered, with the OS's words for a failure."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return SocketState.ABSENT, "no such file"
    except OSError as exc:
        return SocketState.ERROR, exc.strerror or str(exc)
    if not stat.S_ISSOCK(mode):
        return SocketState.NOT_SOCKET, "not a socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(path)
        except FileNotFoundError:
            return SocketState.ABSENT, "no such file"
        except PermissionError as exc:
            return SocketState.DENIED, exc.strerror or "permission denied"
        except OSError as exc:
            if exc.errno == errno.ECONNREFUSED:
                return SocketState.STALE, "connection refused"
            return SocketState.ERROR, exc.strerror or str(exc)
    return SocketState.LIVE, "accepting connections"


def clear_stale_socket(path: str) -> None:
    """Make room to bind `path`: remove a dead daemon's socket; raise OSError when the path
    is not a socket or a live (or someone else's) daemon answers there."""
    state, detail = probe_socket(path)
    if state is SocketState.ABSENT:
        return
    if state is SocketState.STALE:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    if state is SocketState.NOT_SOCKET:
        raise OSError(f"{path} exists and is not a socket")
    raise OSError(f"another kvd daemon is serving on {path} ({detail})")


def closed_directory(path: str, advice: str) -> str | None:
    """Why this user cannot reach `path` when a directory on the way is the reason (no search
    permission: the daemon's socket directory is 0750, for its user and group only): that
    directory, its owner, group and mode, then `advice` (`{group}`: the directory's group);
    None when every directory lets this user through."""
    chain = [os.path.dirname(os.path.abspath(path))]
    while os.path.dirname(chain[-1]) != chain[-1]:
        chain.append(os.path.dirname(chain[-1]))
    for directory in reversed(chain):
        if not os.path.isdir(directory):
            return None         # not there, or a file: not a matter of permissions
        if os.access(directory, os.X_OK):
            continue
        uid = os.getuid()
        try:
            st = os.stat(directory)
        except OSError as exc:
            return f"the directory {directory} does not let uid {uid} in ({exc.strerror})"
        return (f"the directory {directory} (owner uid {st.st_uid}, group {st.st_gid}, mode "
                f"{stat.S_IMODE(st.st_mode):04o}) does not let uid {uid} in; "
                + advice.format(group=st.st_gid))
    return None
