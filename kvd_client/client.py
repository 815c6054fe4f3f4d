"""KvdClient: an engine's session with the daemon, engine-neutral.

The rule it serves: the daemon may be slow, crash or restart, and the engine keeps
serving. Every public method returns quickly and never raises: while the daemon is unreachable
or draining the client is *degraded* (`available` is False, `step` returns None) and a
background thread reconnects with backoff. Calls that need no answer (completions, touches,
transfer reports) are queued and ride with the next `step`, so an engine makes at most one round
trip per scheduler step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import grpc

from kvd_client.attach import AttachError, AttachInfo, attach
from kvd_client.pool_map import PoolMapping
from kvd_client.register import RegisterFailed, register, session_fds
from kvd_client.step_stream import StepStream, StepStreamClosed, status_code
from kvd_proto import kvd_pb2, kvd_pb2_grpc
from kvd_proto.attach import ROLE_BELOW, ROLE_CHANNEL, ROLE_DATAPLANE, ROLE_INDEX
from kvd_proto.paths import default_socket_path
from kvd_proto.wire import MAX_OPS_PER_STEP, KvLayout

log = logging.getLogger(__name__)

MAX_QUEUED_OPS = MAX_OPS_PER_STEP - 56   # room for the step's own ops
RETIRED_MAPPINGS = 2            # earlier pool mappings kept open for copies still running
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
# wait_available asks for a retry at most this often (the background thread backs off between
# tries; a refused registration must not be retried every poll).
WAIT_POKE_S = 0.25
# KVD_CLIENT_STEP_STREAM=0 sends every step as a unary Step call (for comparison and for
# daemons behind proxies without bidirectional streams).
USE_STEP_STREAM = os.environ.get("KVD_CLIENT_STEP_STREAM", "1").strip().lower() not in (
    "0", "false", "no", "off")
# Codes after which the session is gone or the daemon is unusable: degrade and reconnect.
_FATAL = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
          grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.CANCELLED,
          grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class KvdClient:
    """A session with the kvd daemon at `socket_path` (see docs/client.md)."""

    def __init__(self, socket_path: str | None = None, *, model: str, layout: KvLayout,
                 salt: str = "", engine_id: str = "", engine_kind: str = "",
                 engine_version: str = "", deadline_s: float = 0.5, connect: bool = True,
                 on_reconnect: Callable[[], None] | None = None) -> None:
        self.socket_path = socket_path or default_socket_path()
        self.model = model
        self.layout = layout
        self.salt = salt
        self.engine = kvd_pb2.EngineIdentity(engine_id=engine_id, engine_kind=engine_kind,
                                             engine_version=engine_version, pid=os.getpid(),
                                             hostname=socket.gethostname())
        self.deadline_s = deadline_s
        self.on_reconnect = on_reconnect

        self.available = False
        self.epoch: int | None = None
        self.slot_bytes: int | None = None
        self.namespace_id: str | None = None
        self.session_id: str | None = None
        # The session before the last reconnect: what the daemon still holds for it (its pins
        # and store slots, since this process lived on) is released by release_held().
        self.previous_session_id: str | None = None
        self.pool: PoolMapping | None = None
        self.pool_id: str | None = None
        self.instance_id: str | None = None
        self.draining = False
        self.round_trips = 0
        self.generation = 0          # +1 at every (re)connect: engines drop local state on change
        # The generation whose on_reconnect set-up has run (wait_available waits for it).
        self._ready_generation = 0
        self.heartbeat_interval_s = 1.0

        self._lock = threading.RLock()
        self._queue: deque[kvd_pb2.StepOp] = deque()
        self._channel: grpc.Channel | None = None
        self._stub: kvd_pb2_grpc.KvdEngineStub | None = None
        self._metadata: tuple[tuple[str, str], ...] = ()
        self._stream: grpc.Future | None = None
        self._steps: StepStream | None = None
        self._use_step_stream = USE_STEP_STREAM
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._backoff = BACKOFF_MIN_S
        self._next_attempt = 0.0
        self._ever_connected = False
        self._last_error_log = 0.0
        self._thread: threading.Thread | None = None
        self._retired: list[PoolMapping] = []
        if connect:
            self._try_connect()
            self._thread = threading.Thread(target=self._background, name="kvd-client",
                                            daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ public API
    def step(self, ops: Sequence[kvd_pb2.StepOp], *, deadline_s: float | None = None
             ) -> list[kvd_pb2.StepResult] | None:
        """Queued ops + `ops` in one Step RPC; the results of `ops`, or None when degraded."""
        try:
            return self._step(list(ops), deadline_s)
        except Exception:  # never let a kvd bug reach the engine
            log.exception("kvd step failed unexpectedly")
            return None

    def queue(self, op: kvd_pb2.StepOp) -> None:
        """Send `op` with the next round trip (ops that need no answer)."""
        with self._lock:
            if not self.available:
                return  # nothing to complete on a daemon that is gone
            if len(self._queue) >= MAX_QUEUED_OPS:
                self._queue.popleft()
                self._rate_limited_warning("kvd client queue full; dropping the oldest op")
            self._queue.append(op)

    def current_pool(self) -> tuple[str | None, PoolMapping | None]:
        """(pool id, this process's mapping of it) as one pair: a reconnect replaces both at
        once, so an engine that copies by slot offsets checks the id its offsets came with."""
        with self._lock:
            return self.pool_id, self.pool

    def map_index(self) -> tuple[int, ...] | None:
        """Descriptors of this session's namespace index (read-only) and of its marks file, or
        None (degraded, or a daemon without a shared index). The caller owns them."""
        return self._attach_session(ROLE_INDEX, "no shared index; lookups answer MISS")

    def map_channel(self) -> tuple[int, ...] | None:
        """Descriptors of this session's channel (its rings' memory file, read/write) and of
        the daemon's eventfd for it, or None. The caller owns them."""
        return self._attach_session(ROLE_CHANNEL, "no channel; offload stays off")

    def map_below(self) -> int | None:
        """The descriptor of this session's namespace's "held below" table (read-only), or
        None: the daemon has no tier under the pool (or is an older one), or is away."""
        fds = self._attach_session(ROLE_BELOW, "no tier below the pool is visible; keys "
                                   "held there answer MISS", 1, quiet="FAILED_PRECONDITION")
        return fds[0] if fds else None

    def _attach_session(self, role: str, consequence: str, count: int = 2, quiet: str = ""
                        ) -> tuple[int, ...] | None:
        """`count` descriptors a registered session asks for on the attach socket; a refusal
        with the status `quiet` is not warned about."""
        token = self._metadata[0][1] if self._metadata else ""
        if not token or not self.available:
            return None
        try:
            return session_fds(self.socket_path, role, token, max(self.deadline_s, 1.0), count)
        except AttachError as exc:
            if exc.code != quiet:
                self._rate_limited_warning(f"kvd: {consequence} ({exc.code}: {exc.message})")
            return None

    def release_held(self, session_id: str) -> None:
        """Tell the daemon that every copy of this process's earlier session `session_id` has
        finished, so what it still holds for it (pins, store slots) can go back to the pool."""
        self.queue(kvd_pb2.StepOp(release_held=kvd_pb2.ReleaseHeldRequest(
            session_id=session_id)))

    def flush(self, *, deadline_s: float | None = None) -> bool:
        """Send queued ops if there are any (one round trip); no RPC otherwise."""
        if not self._queue:
            return True
        return self.step([], deadline_s=deadline_s) is not None

    def maybe_reconnect(self) -> bool:
        """Ask the background thread to retry now (never blocks the caller)."""
        if not self.available:
            self._next_attempt = 0.0
            self._wake.set()
        return self.available

    def close(self) -> None:
        """End the session (best effort) and stop the background thread.

        Closing says this process has no copies in flight any more: the daemon releases what
        the session holds, and what it still held for the session before a reconnect.
        """
        with self._lock:
            # Before the heartbeat stream stops: a stream that ends first would end the
            # session as if the process had lost it (its holdings kept), not closed it.
            stub, md = self._stub, self._metadata
            if stub is not None and self.available:
                with contextlib.suppress(grpc.RpcError):
                    if self.previous_session_id:
                        stub.ReleaseHeld(kvd_pb2.ReleaseHeldRequest(
                            session_id=self.previous_session_id), timeout=self.deadline_s,
                            metadata=md)
                    stub.CloseSession(kvd_pb2.CloseSessionRequest(), timeout=self.deadline_s,
                                      metadata=md)
            self._closed.set()
            self._wake.set()
            self._teardown()
            for mapping in [*self._retired, self.pool]:
                if mapping is not None:
                    mapping.close()
            self._retired.clear()
            self.pool = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.deadline_s + 1)

    def wait_available(self, timeout: float) -> bool:
        """Block until connected and the connection's `on_reconnect` set-up has run (tests,
        start-up scripts: a session's index, channel and first slots are then in place for
        its next step); True if so."""
        end = time.monotonic() + timeout
        poked = 0.0
        while time.monotonic() < end:
            if self._ready():
                return True
            if time.monotonic() - poked >= WAIT_POKE_S:   # a retry now, not every 20 ms
                poked = time.monotonic()
                self.maybe_reconnect()
            time.sleep(0.02)
        return self._ready()

    def _ready(self) -> bool:
        return self.available and self._ready_generation == self.generation

    # -------------------------------------------------------------------- internals
    def _step(self, ops: list[kvd_pb2.StepOp], deadline_s: float | None
              ) -> list[kvd_pb2.StepResult] | None:
        with self._lock:
            if not self.available or self._stub is None:
                self.maybe_reconnect()
                return None
            queued = list(self._queue)
            self._queue.clear()
            request = kvd_pb2.StepRequest(ops=queued + ops)
            deadline = deadline_s or self.deadline_s
            self.round_trips += 1
            try:
                response = self._send(request, deadline)
            except (grpc.RpcError, StepStreamClosed) as err:
                if isinstance(err, StepStreamClosed):
                    code, details = err.code, err.details
                else:
                    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
                    details = err.details() if hasattr(err, "details") else str(err)
                self._rejected(code, details)
                return None
            if response.error_code:
                self._rejected(status_code(response.error_code), response.error_message)
                return None
            if response.epoch:
                self.epoch = response.epoch
            return list(response.results[len(queued):])

    def _send(self, request: kvd_pb2.StepRequest, deadline: float) -> kvd_pb2.StepResponse:
        """One step on the open StepStream (opened on first use), or as a unary call when the
        daemon has no StepStream or it is turned off (caller holds the lock)."""
        assert self._stub is not None
        if self._use_step_stream:
            if self._steps is None:
                self._steps = StepStream(self._stub, self._metadata)
            try:
                return self._steps.call(request, deadline)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                # An older daemon: nothing ran; use unary Step on this connection from now on.
                log.info("kvd daemon has no StepStream; using unary Step calls")
                self._steps.close()
                self._steps = None
                self._use_step_stream = False
        return self._stub.Step(request, timeout=deadline, metadata=self._metadata)

    def _rejected(self, code: grpc.StatusCode, details: str) -> None:
        if code in _FATAL:
            self._degrade(f"{code.name}: {details}")
        else:
            # A request the daemon rejected (a bug or a stale epoch): drop it, stay up.
            self._rate_limited_warning(f"kvd rejected a step: {code.name}: {details}")

    def _try_connect(self) -> bool:
        """Register a session (register.py) and adopt it. False (quietly) on failure."""
        try:
            reg = register(self.socket_path, engine=self.engine, model=self.model,
                           layout=self.layout, salt=self.salt, timeout=max(self.deadline_s, 1.0))
        except RegisterFailed as exc:
            self._note_failure(str(exc))
            return False
        with self._lock:
            self._teardown()
            self._retire_pool()
            self._channel, self._stub, self._metadata = reg.channel, reg.stub, reg.metadata
            self.pool, self.pool_id, self.instance_id = reg.pool, reg.pool_id, reg.instance_id
            self.epoch, self.slot_bytes = reg.epoch, reg.slot_bytes
            self.namespace_id = reg.namespace_id
            self.previous_session_id, self.session_id = self.session_id, reg.session_id
            self.heartbeat_interval_s = reg.heartbeat_interval_s
            self.draining = False
            self.available = True
            self.generation += 1
            self._backoff = BACKOFF_MIN_S
        if self._ever_connected:
            log.info("kvd daemon back at %s: session %s, namespace %s, epoch %d",
                     self.socket_path, reg.session_id, reg.namespace_id, reg.epoch)
        else:
            log.info("kvd session %s at %s: namespace %s, %d-byte slots, %d-byte pool",
                     reg.session_id, self.socket_path, reg.namespace_id, reg.slot_bytes,
                     reg.pool_bytes)
        self._ever_connected = True
        generation = self.generation
        if self.on_reconnect is not None:
            try:
                self.on_reconnect()
            except Exception:
                log.exception("on_reconnect callback failed")
        self._ready_generation = generation
        return True

    def _note_failure(self, reason: str) -> None:
        now = time.monotonic()
        self._next_attempt = now + self._backoff * (0.5 + random.random())
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        if not self._ever_connected and now - self._last_error_log > 30:
            self._last_error_log = now
            log.warning("kvd daemon unavailable at %s (%s); offload disabled until it is up",
                        self.socket_path, reason)

    def drop_session(self, reason: str) -> None:
        """Degrade now: this session is given up (its channel and streams closed) and the
        background thread registers a new one (a caller that can no longer keep its promises
        to the daemon, e.g. messages it could not deliver). Never blocks on the daemon."""
        self._degrade(reason)

    def _degrade(self, reason: str) -> None:
        with self._lock:
            if not self.available:
                return
            self.available = False
            self._teardown()
        log.warning("kvd daemon unreachable at %s: %s; offload disabled until it is back",
                    self.socket_path, reason)
        self._next_attempt = time.monotonic() + BACKOFF_MIN_S
        self._backoff = BACKOFF_MIN_S
        self._wake.set()

    def _teardown(self) -> None:
        """Drop channel, stream and mapping (caller holds the lock)."""
        self.available = False
        self._queue.clear()
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        if self._steps is not None:
            self._steps.close()
            self._steps = None
        self._use_step_stream = USE_STEP_STREAM
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None

    def _retire_pool(self) -> None:
        """Replace-time clean-up of the pool mapping (caller holds the lock).

        The mapping outlives the session it came with: an engine thread may still be copying
        with offsets from an earlier step when the daemon goes away, so a degraded client keeps
        `pool` as it was. A mapping is closed only once two newer ones replaced it (copies are
        far shorter than two reconnects), or at close().
        """
        if self.pool is not None:
            self._retired.append(self.pool)
            while len(self._retired) > RETIRED_MAPPINGS:
                self._retired.pop(0).close()

    def _background(self) -> None:
        """Keeps the liveness stream open while connected; reconnects with backoff when not."""
        while not self._closed.is_set():
            if self.available:
                self._run_stream()
                continue
            delay = self._next_attempt - time.monotonic()
            if delay > 0:
                self._wake.wait(min(delay, BACKOFF_MAX_S))
                self._wake.clear()
                continue
            self._try_connect()

    def _run_stream(self) -> None:
        with self._lock:
            stub, md = self._stub, self._metadata
            generation = self.generation
        if stub is None:
            return
        last_notice = [time.monotonic()]
        interval = self.heartbeat_interval_s
        silent_limit = max(3 * interval, 4 * self.deadline_s)

        def beats() -> Iterator[kvd_pb2.SessionHeartbeat]:
            seq = 0
            while not self._closed.is_set() and self.generation == generation and self.available:
                seq += 1
                yield kvd_pb2.SessionHeartbeat(seq=seq)
                self._closed.wait(interval)
                if time.monotonic() - last_notice[0] > silent_limit:
                    self._degrade(f"no answer to heartbeats for {silent_limit:.1f}s")
                    return

        try:
            call = stub.SessionStream(beats(), metadata=md)
            with self._lock:
                if self.generation != generation:
                    call.cancel()
                    return
                self._stream = call
            for notice in call:
                last_notice[0] = time.monotonic()
                if notice.epoch:
                    self.epoch = notice.epoch
                if notice.state == kvd_pb2.DAEMON_STATE_DRAINING and not self.draining:
                    self.draining = True
                    self._degrade("daemon is draining")
                    return
            reason = "session stream ended"
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            reason = f"session stream: {code.name if code else err}"
        if not self._closed.is_set() and self.generation == generation:
            self._degrade(reason)

    def _rate_limited_warning(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_error_log > 10:
            self._last_error_log = now
            log.warning(message)


def attach_dataplane(socket_path: str | None = None, timeout: float = 2.0
                     ) -> tuple[AttachInfo, PoolMapping]:
    """For an engine's worker processes: just the pool (no session). Raises AttachError."""
    info = attach(socket_path or default_socket_path(), role=ROLE_DATAPLANE, timeout=timeout)
    return info, PoolMapping(info.fd, info.pool_bytes)
