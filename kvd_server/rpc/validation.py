"""What the gRPC services check of a request before the core sees it: every bound the proto
states (kvd_proto.wire), the stated message limit, and the metadata a call carries. A broken
bound is an InvalidArgument naming the field, answered by the recorder as INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf.message import Message

from kvd_proto import kvd_pb2
from kvd_proto.wire import (
    MAX_KEY_BYTES,
    MAX_KEYS_PER_CALL,
    MAX_MESSAGE_BYTES,
    MAX_STRING_BYTES,
)
from kvd_server.errors import (
    InvalidArgument,
)


def check_keys(keys: Sequence[bytes], field: str = "keys") -> list[bytes]:
    if len(keys) > MAX_KEYS_PER_CALL:
        raise InvalidArgument(f"{field} has {len(keys)} keys, more than MAX_KEYS_PER_CALL "
                              f"({MAX_KEYS_PER_CALL})")
    seen: dict[bytes, int] = {}
    for i, key in enumerate(keys):
        if not key:
            raise InvalidArgument(f"{field}[{i}] is empty (MAX_KEY_BYTES: keys are "
                                  f"1..{MAX_KEY_BYTES} bytes)")
        if len(key) > MAX_KEY_BYTES:
            raise InvalidArgument(f"{field}[{i}] has {len(key)} bytes, more than MAX_KEY_BYTES "
                                  f"({MAX_KEY_BYTES})")
        first = seen.setdefault(key, i)
        if first != i:
            raise InvalidArgument(f"{field}[{i}] duplicates {field}[{first}] (duplicate keys "
                                  "are not allowed within one call)")
    return list(keys)


def check_str(value: str, field: str, *, required: bool = False,
               identity: bool = False) -> str:
    """A bounded string; `identity` strings (what names a namespace or an engine) must not
    hold control characters, so no two different identities can print or hash alike."""
    size = len(value.encode())
    if size > MAX_STRING_BYTES:
        raise InvalidArgument(f"{field} has {size} bytes, more than {MAX_STRING_BYTES}")
    if required and not size:
        raise InvalidArgument(f"{field} is required (1..{MAX_STRING_BYTES} bytes)")
    if identity:
        bad = next((c for c in value if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0), None)
        if bad is not None:
            raise InvalidArgument(f"{field} holds the control character {bad!r} "
                                  f"(U+{ord(bad):04X}); identity strings must be printable")
    return value


def check_positions(positions: Sequence[int], n: int) -> list[int] | None:
    if not positions:
        return None
    if len(positions) != n:
        raise InvalidArgument(f"positions has {len(positions)} entries for {n} keys (must be "
                              "empty or one per key)")
    return list(positions)


def op_keys(op: kvd_pb2.StepOp) -> int:
    kind = op.WhichOneof("op")
    if kind is None:
        return 0
    inner = getattr(op, kind)
    return len(inner.keys) if hasattr(inner, "keys") else 0


def check_size(request: Message) -> None:
    """The stated message limit, answered as the bound it is (the transport reads up to
    TRANSPORT_MESSAGE_BYTES, so an oversized request reaches this check)."""
    size = request.ByteSize()
    if size > MAX_MESSAGE_BYTES:
        raise InvalidArgument(f"request of {size} bytes is over MAX_MESSAGE_BYTES "
                              f"({MAX_MESSAGE_BYTES}); split it")


def metadata_value(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None
