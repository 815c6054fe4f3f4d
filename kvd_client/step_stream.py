"""Steps in lockstep on one open `KvdEngine.StepStream`, with a per-step deadline.

A message on an open gRPC stream costs about half a unary call in Python (bench/README.md), and
the scheduler makes one step per iteration, so the client keeps one stream open per session.
gRPC's synchronous stream has no per-message timeout: a watchdog thread cancels the stream when
the step in flight passes its deadline, which makes the waiting `next()` raise at once. The
watchdog sleeps until a step's deadline (or, with none in flight, until one is set): a thread
that woke on a timer would take the GIL from a scheduler thread running flat out, every time.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc

from kvd_proto import kvd_pb2, kvd_pb2_grpc

_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The gRPC status code of a StepResponse.error_code number."""
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


class StepStreamClosed(Exception):
    """The stream ended or was cancelled; `code` says why (DEADLINE_EXCEEDED after the watchdog
    cancelled it, else the stream's status)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class StepStream:
    """One stream; `call` sends a step and waits for its answer. Not for concurrent callers
    (KvdClient holds its lock around each step)."""

    def __init__(self, stub: kvd_pb2_grpc.KvdEngineStub,
                 metadata: tuple[tuple[str, str], ...]) -> None:
        self._requests: queue.SimpleQueue[kvd_pb2.StepRequest | None] = queue.SimpleQueue()
        self._call = stub.StepStream(iter(self._requests.get, None), metadata=metadata)
        self._deadline = 0.0          # monotonic deadline of the step in flight; 0: none
        self._changed = threading.Condition()     # a deadline set, or the stream closed
        self._closed = threading.Event()
        self.timed_out = False
        self._watchdog = threading.Thread(target=self._watch, name="kvd-step-watchdog",
                                          daemon=True)
        self._watchdog.start()

    def call(self, request: kvd_pb2.StepRequest, deadline_s: float) -> kvd_pb2.StepResponse:
        """The step's answer (check its error_code); raises StepStreamClosed when the stream
        is gone, grpc.RpcError with UNIMPLEMENTED when the daemon has no StepStream."""
        if self._closed.is_set():
            raise StepStreamClosed(grpc.StatusCode.CANCELLED, "step stream closed")
        with self._changed:
            self._deadline = time.monotonic() + deadline_s
            self._changed.notify()
        self._requests.put(request)
        try:
            return next(self._call)
        except StopIteration:
            raise StepStreamClosed(grpc.StatusCode.UNAVAILABLE, "step stream ended") from None
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise
            if self.timed_out:
                raise StepStreamClosed(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"no answer within {deadline_s:g}s") from None
            details = err.details() if hasattr(err, "details") else str(err)
            raise StepStreamClosed(code, details or "") from None
        finally:
            self._deadline = 0.0

    def close(self) -> None:
        if not self._closed.is_set():
            with self._changed:
                self._closed.set()
                self._changed.notify()
            self._requests.put(None)
            self._call.cancel()

    def _watch(self) -> None:
        """Sleep until the step in flight passes its deadline (cancel the stream then), or
        until a step starts; with no step in flight, until one does."""
        with self._changed:
            while not self._closed.is_set():
                deadline = self._deadline
                if not deadline:
                    self._changed.wait()
                    continue
                left = deadline - time.monotonic()
                if left > 0:
                    self._changed.wait(left)
                    continue
                self.timed_out = True
                self._closed.set()
                self._call.cancel()
                return
