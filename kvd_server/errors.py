"""The daemon's errors: one hierarchy, each class carrying the gRPC status it is answered with.

The core, the manager and the request checks raise these; the service turns `code` (a gRPC
status name, so this module needs no grpc import) into a status, the attach server into a
refusal and the CLI into a message and an exit code. Anything else that escapes a handler is
a bug: answered INTERNAL and logged.
"""

from __future__ import annotations


class KvdError(Exception):
    """Base: `code` is the gRPC status name the failure is answered with."""

    code: str = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KvdError):
    """Malformed request: a bound exceeded, a bad key, layout, offset or string."""

    code = "INVALID_ARGUMENT"


class Unauthenticated(KvdError):
    """Missing or unknown session token."""

    code = "UNAUTHENTICATED"


class PermissionDenied(KvdError):
    """The peer may not do this (not on the allowlist, not an admin)."""

    code = "PERMISSION_DENIED"


class NotFound(KvdError):
    """An unknown namespace."""

    code = "NOT_FOUND"


class FailedPrecondition(KvdError):
    """The call does not fit the state: unregistered session, an epoch from the future."""

    code = "FAILED_PRECONDITION"


class NotReady(FailedPrecondition):
    """prepare_load named a key that is absent, evicted or still being stored."""

    def __init__(self, key: bytes, index: int) -> None:
        super().__init__(f"key #{index} ({key[:16].hex()}) is not a readable block (absent, "
                         "evicted or still being stored); look it up again")
        self.key = key
        self.index = index


class ResourceExhausted(KvdError):
    """Too many sessions, namespaces or leases."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(KvdError):
    """The daemon is draining or not ready."""

    code = "UNAVAILABLE"


def prefixed(exc: KvdError, prefix: str) -> KvdError:
    """The same failure (same status), its message prefixed: e.g. which op of a step failed."""
    out = KvdError(f"{prefix}: {exc.message}")
    out.code = exc.code
    return out
