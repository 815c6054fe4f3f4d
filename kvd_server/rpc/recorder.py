"""Per-call bookkeeping of the gRPC services: `RpcRecorder.run` times every handler, unary or
a message on a stream, counts it, and maps a failure to its status in one place (`KvdError.code`
through `grpc_status`; anything else is a bug, logged once and answered INTERNAL)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc

from kvd_server.errors import (
    KvdError,
)
from kvd_server.ops.stats import RpcCount

log = logging.getLogger(__name__)
T = TypeVar("T")


def grpc_status(code: str) -> grpc.StatusCode:
    """The status of a KvdError code name (the one code -> status table)."""
    return grpc.StatusCode[code]


# --- validation ----------------------------------------------------------------------------


class TransferObserver(Protocol):
    """What the Prometheus side observes on the request path (metrics.RpcMetrics)."""

    def observe(self, method: str, seconds: float, code: str = "OK") -> None: ...

    def observe_step(self, ops: int, keys: int) -> None: ...

    def observe_transfer(self, load_sizes: Sequence[int], store_sizes: Sequence[int]) -> None: ...


@dataclass(slots=True)
class Outcome:
    """A handler's result: its response, or the status it failed with."""

    response: object = None
    code: str = "OK"
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code == "OK"


class RpcRecorder:
    """Counts calls and errors per method (the stats document's `rpc` section), feeds the
    Prometheus metrics when they are on, and runs every handler under the one error mapping."""

    def __init__(self, metrics: TransferObserver | None = None) -> None:
        self.counts: dict[str, RpcCount] = {}
        self._metrics = metrics

    def record(self, method: str, seconds: float, code: str) -> None:
        count = self.counts.get(method)
        if count is None:
            count = self.counts[method] = RpcCount()
        count.calls_total += 1
        if code != "OK":
            count.errors_total += 1
        if self._metrics is not None:
            self._metrics.observe(method, seconds, code)

    def observe_step(self, ops: int, keys: int) -> None:
        if self._metrics is not None:
            self._metrics.observe_step(ops, keys)

    def observe_transfer(self, load_sizes: Sequence[int], store_sizes: Sequence[int]) -> None:
        if self._metrics is not None:
            self._metrics.observe_transfer(load_sizes, store_sizes)

    def run(self, method: str, handle: Callable[[], T]) -> Outcome:
        """Run one call (or one message of a stream), timed and recorded."""
        start = time.perf_counter()
        try:
            outcome = Outcome(handle())
        except KvdError as exc:
            outcome = Outcome(None, exc.code, exc.message)
        except Exception:
            log.exception("%s failed", method)
            outcome = Outcome(None, "INTERNAL", "internal error (see the daemon's log)")
        self.record(method, time.perf_counter() - start, outcome.code)
        return outcome

    async def unary(self, method: str, context: grpc.aio.ServicerContext,
                    handle: Callable[[], T]) -> T:
        """A unary call: its response, or the context aborted with the failure's status."""
        outcome = self.run(method, handle)
        if not outcome.ok:
            await context.abort(grpc_status(outcome.code), outcome.message)
        return outcome.response  # type: ignore[return-value]


def is_server_stopping(exc: BaseException) -> bool:
    # grpc.aio raises this private type into a stream's reader when the server stops.
    return type(exc).__name__ == "_ServerStoppedError"
