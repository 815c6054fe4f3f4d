"""Attaching to the daemon (docs/attach.md): the pool's descriptor and a session token.

The exchange itself is `kvd_proto.attach.exchange`, shared with the `kvd` CLI; this module
turns a successful answer into an `AttachInfo` that owns exactly one descriptor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvd_proto.attach import ROLE_ENGINE, AttachError, AttachRequest, exchange
from kvd_proto.wire import SLOT_ALIGNMENT

__all__ = ["AttachError", "AttachInfo", "attach"]


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


def attach(socket_path: str, *, role: str = ROLE_ENGINE, engine_id: str = "",
           timeout: float = 2.0) -> AttachInfo:
    """Attach to the daemon serving `socket_path` (the gRPC socket; `.attach` is derived)."""
    doc, fds = exchange(socket_path, AttachRequest(role, engine_id), timeout)
    try:
        if len(fds) != 1:
            raise AttachError("INTERNAL", f"attach reply carried {len(fds)} descriptors, not 1")
        info = AttachInfo(fd=fds[0], token=str(doc.get("token", "")),
                          session_id=str(doc.get("session_id", "")),
                          pool_bytes=int(doc["pool_bytes"]),
                          pool_id=str(doc.get("pool_id", "")),
                          instance_id=str(doc.get("instance_id", "")),
                          slot_alignment=int(doc.get("slot_alignment", SLOT_ALIGNMENT)),
                          daemon_version=str(doc.get("daemon_version", "")),
                          tenant=str(doc.get("tenant", "")))
    except (KeyError, TypeError, ValueError) as exc:
        for fd in fds:
            os.close(fd)
        raise AttachError("INTERNAL", f"malformed attach reply: {exc}") from None
    except AttachError:
        for fd in fds:
            os.close(fd)
        raise
    return info
