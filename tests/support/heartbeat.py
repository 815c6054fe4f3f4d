"""A session's heartbeat stream, kept the way a client keeps it (every 200 ms until `stop`):
for test engines that speak the gRPC contract directly. Imports only grpc and kvd_pb2, so a
client written from the docs alone may use it too."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvd_proto import kvd_pb2

BEAT_S = 0.2


def keep_alive(stub: Any, md: Any, stop: threading.Event,
               on_notice: Callable[[kvd_pb2.SessionNotice], None] | None = None) -> None:
    """Run the session's heartbeat stream until `stop` is set or the stream ends."""

    def beats() -> Iterator[kvd_pb2.SessionHeartbeat]:
        seq = 0
        while not stop.is_set():
            seq += 1
            yield kvd_pb2.SessionHeartbeat(seq=seq)
            stop.wait(BEAT_S)

    with contextlib.suppress(grpc.RpcError, ValueError):
        for notice in stub.SessionStream(beats(), metadata=md):
            if on_notice is not None:
                on_notice(notice)
