"""The daemon's errors, each tied to the gRPC status code it is answered with.

This is the one place where status codes are chosen (CONVENTIONS.md): the core raises these,
the service turns them into statuses, the CLI into messages and exit codes.
"""

from __future__ import annotations

import grpc


class KvdError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KvdError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(KvdError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KvdError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(KvdError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(KvdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(KvdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KvdError):
    code = grpc.StatusCode.UNAVAILABLE
