"""Where the daemon's sockets are, by the same rule the daemon uses (no server import)."""

from __future__ import annotations

import os


def default_socket_path() -> str:
    """`$KVD_SOCKET`, else `$XDG_RUNTIME_DIR/kvd/kvd.sock`, else `/tmp/kvd-$UID/kvd.sock`."""
    explicit = os.environ.get("KVD_SOCKET") or os.environ.get("KVD_SERVER_SOCKET")
    if explicit:
        return explicit
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "kvd", "kvd.sock")
    return f"/tmp/kvd-{os.getuid()}/kvd.sock"


def attach_path(socket_path: str) -> str:
    """The attach side channel lies beside the gRPC socket."""
    return socket_path + ".attach"


def grpc_target(socket_path: str) -> str:
    """gRPC target string for a Unix socket path."""
    return "unix://" + os.path.abspath(socket_path)
