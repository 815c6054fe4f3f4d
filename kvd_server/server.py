"""Assembles a running daemon: pool, core, gRPC (engine, admin, health), attach server, sweeper,
metrics, signals, drain and systemd notifications.

`serve(config)` returns the process exit code: 0 after a drain, 1 when the daemon cannot start
(another daemon on the socket, a pool it cannot create, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import gc
import logging
import mmap
import os
import resource
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections import Counter
from importlib.util import find_spec
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvd_proto import kvd_pb2, kvd_pb2_grpc
from kvd_proto.channel import ChannelHeader
from kvd_proto.native import NATIVE
from kvd_proto.paths import (
    ATTACH_SUFFIX,
    SocketState,
    attach_path,
    grpc_target,
    probe_socket,
    socket_lock_path,
)
from kvd_proto.wire import TRANSPORT_MESSAGE_BYTES, channel_options
from kvd_server import __version__
from kvd_server.attach.roles import AttachRoles
from kvd_server.attach.server import AttachServer
from kvd_server.channel.hub import ChannelHub
from kvd_server.channel.service import ChannelService
from kvd_server.config import DEFAULT_TENANT, Config, PoolConfig
from kvd_server.core.core import KvdCore
from kvd_server.core.sessions import Session
from kvd_server.memory.extents import ExtentAllocator
from kvd_server.memory.pool import HostPool, PoolError, check_fits
from kvd_server.memory.tenant_pools import TenantPools
from kvd_server.ops import notify
from kvd_server.ops.snapshot import build_snapshot
from kvd_server.ops.stats import (
    ChannelStats,
    ConnectionStats,
    DaemonFacts,
    RestartStats,
    StatsSnapshot,
)
from kvd_server.protocols.wiring import EngineProtocols
from kvd_server.restart.state import StateError
from kvd_server.restart.warm import WarmRestart
from kvd_server.rpc.admin import AdminService
from kvd_server.rpc.admin_tokens import AdminTokens, TokenFileError, read_token_file
from kvd_server.rpc.engine import EngineService
from kvd_server.rpc.front_door import FrontDoor
from kvd_server.rpc.recorder import RpcRecorder
from kvd_server.units import format_duration, format_size

if TYPE_CHECKING:
    from kvd_server.core.namespaces import Namespace
    from kvd_server.ops.metrics import MetricsServer, RpcMetrics
    from kvd_server.tiers.link import TierLink

log = logging.getLogger(__name__)

# The index loops run on their Python twins although kvd_proto._native was built: forced by
# KVD_NATIVE=0 in this environment (`kvd stats` and the start-up WARNING say so, not "no C
# compiler", whose fix is another).
NATIVE_FORCED = not NATIVE and find_spec("kvd_proto._native") is not None

SWEEP_INTERVAL = 0.1
TUNE_GC_AFTER_S = 1.0        # tune_gc this long after SERVING (the GC is off until then)
PREFAULT_EXTEND_S = 60.0
TRIM_INTERVAL = 10.0         # how often tenants' pool files are checked for stray pages
DRAIN_POLL = 0.05
STOP_GRACE = 1.0
MAX_OWED = 64          # Drain answers a shutdown waits for (more calls are answered or cut)
HEALTH_SERVICES = ("", "kvd.v1.KvdEngine")
ACTIVITY_S = 1.0       # at debug: at most one activity line this often (Activity)
MAX_NAMED = 4          # namespaces named in one activity line
LOCK_TRIES = 3         # the lock file replaced under us by a daemon exiting: open it again
LOCK_RETRIES = 5       # a `kvd health --wait` testing the lock holds it for microseconds
LOCK_RETRY_S = 0.01


class StartupError(Exception):
    """The daemon cannot start; the message tells the operator what to do."""


def _prepare_socket_path(path: str) -> int:
    """Create the socket directory (0750), take the socket path's lock and clear a stale
    socket; refuse a live daemon. The lock's descriptor (held until the daemon exits)."""
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        blocker = _file_in_the_way(directory)
        if blocker:
            raise StartupError(f"cannot create the socket directory {directory}: {blocker} is "
                               "a file, not a directory; choose another --socket")
        try:
            os.makedirs(directory, mode=0o750, exist_ok=True)
            os.chmod(directory, 0o750)
        except OSError as exc:
            raise StartupError(f"cannot create the socket directory {directory}: "
                               f"{exc.strerror}; create it or choose --socket") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        name = os.path.basename(path)
        raise StartupError(_unwritable(directory, f"the sockets {name} and {name}{ATTACH_SUFFIX}"))
    lock = _lock_socket_path(path)
    try:
        for candidate in (path, attach_path(path)):
            state, _ = probe_socket(candidate)
            if state is SocketState.NOT_SOCKET:
                raise StartupError(f"{candidate} exists and is not a socket; remove it or "
                                   "choose another --socket")
            if state in (SocketState.LIVE, SocketState.DENIED, SocketState.ERROR):
                # EACCES and friends: someone else's live socket we may not touch.
                raise StartupError(f"another kvd daemon is serving on {candidate}; stop it "
                                   "first (kvd drain --socket ...) or choose another --socket")
            if state is SocketState.STALE:
                log.info("removing stale socket %s", candidate)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(candidate)
    except BaseException:
        _unlock_socket_path(path, lock)
        raise
    return lock


def _unwritable(directory: str, what: str) -> str:
    """One line for a socket directory this process cannot create `what` in."""
    uid = os.geteuid()
    try:
        st = os.stat(directory)
        owner = f"owned by uid {st.st_uid} gid {st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o}"
    except OSError as exc:
        owner = exc.strerror or str(exc)
    with contextlib.suppress(OSError):
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            owner += ", on a read-only file system"
    return (f"cannot create {what} in {directory}: uid {uid} may not write there ({owner}); "
            f"let uid {uid} write in it, run kvd as its owner, or choose another --socket")


def _bind_problem(path: str, exc: OSError) -> str:
    """One line for a socket that cannot be bound (the directory checks passed: a race, a
    security module, ...)."""
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return _unwritable(os.path.dirname(path) or ".", f"the socket {os.path.basename(path)}")
    return f"cannot listen on {path}: {exc.strerror or exc}; choose another --socket"


def _lock_socket_path(path: str) -> int:
    """Take the socket path's lock (see socket_lock_path) and write our pid into it."""
    lock = socket_lock_path(path)
    for _ in range(LOCK_TRIES):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StartupError(f"cannot create the lock file {lock}: {exc.strerror}; choose "
                               "another --socket") from None
        try:
            _flock_exclusive(fd)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise StartupError(
                f"another kvd daemon is serving on {path} or starting there (pid "
                f"{holder or '?'} holds {lock}); stop it first (kvd drain --socket {path}) or "
                "choose another --socket") from None
        try:
            current = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            current = False
        if current:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)    # a daemon that exited removed the file we opened: lock the new one
    raise StartupError(f"cannot lock {lock}: it keeps being replaced; is another kvd daemon "
                       "starting and stopping there?")


def _flock_exclusive(fd: int) -> None:
    """flock(LOCK_EX) without blocking, retried briefly: `kvd health --wait` tests the lock
    with a shared flock for a moment, which must not look like another daemon."""
    for attempt in range(LOCK_RETRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if attempt == LOCK_RETRIES - 1:
                raise
            time.sleep(LOCK_RETRY_S)


def _unlock_socket_path(path: str, fd: int) -> None:
    """Remove the lock file, then let the lock go (a daemon racing us notices the file is
    gone and locks the new one)."""
    with contextlib.suppress(OSError):
        if os.path.samestat(os.fstat(fd), os.stat(socket_lock_path(path))):
            os.unlink(socket_lock_path(path))
    os.close(fd)


def _file_in_the_way(directory: str) -> str | None:
    """The nearest existing ancestor of `directory` (itself included) when it is not a
    directory: the reason a makedirs would fail with "File exists" or "Not a directory"."""
    current = os.path.abspath(directory)
    while not os.path.lexists(current):
        current = os.path.dirname(current)
    return None if os.path.isdir(current) else current


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Daemon:
    """One daemon's parts and its life cycle (start, serve, drain, stop)."""

    def __init__(self, config: Config, *, cold: bool = False) -> None:
        self.config = config
        self._cold = cold
        self._warm: WarmRestart | None = None
        self.pools: TenantPools | None = None
        self.core: KvdCore | None = None
        self._server: grpc.aio.Server | None = None
        self._door: FrontDoor | None = None
        self._private_dir: str | None = None
        self._health = health.aio.HealthServicer()
        self._attach: AttachServer | None = None
        self._admin_server: grpc.aio.Server | None = None
        self._tokens = AdminTokens()
        self._metrics_server: MetricsServer | None = None
        self._rpc = RpcRecorder()
        self._engine: EngineService | None = None
        self._channels: ChannelHub | None = None
        self._channel_service: ChannelService | None = None
        self._stop = asyncio.Event()
        self._stop_prefault = threading.Event()   # read by the pre-fault thread
        self._drain_timeout = config.server.drain_timeout
        self._tasks: list[asyncio.Task[None]] = []
        self._answers: set[asyncio.Future[None]] = set()   # Drain answers not yet written
        self._lock: int | None = None      # the socket path's lock (socket_lock_path)
        self._activity = Activity()
        self._tier: TierLink | None = None    # the tiers under the pool (disk, cluster), if any

    # -- stats and drain entry points

    @property
    def pool(self) -> HostPool | None:
        """The default tenant's pool file (pre-faulted at start; the only one with one
        tenant)."""
        return self.pools.default if self.pools is not None else None

    def snapshot(self) -> StatsSnapshot:
        """The stats document: the core's state plus what only the daemon's parts know."""
        assert self.core is not None and self.pool is not None
        cfg, engine = self.config, self._engine
        return build_snapshot(self.core, DaemonFacts(
            socket=cfg.server.socket, attach_socket=cfg.server.attach_socket,
            backing=self.pools.backing if self.pools else cfg.pool.backing,
            path=(self.pool.path if self.pools and self.pools.warm else cfg.pool.path) or None,
            prefault_bytes_done=self.pool.prefaulted_bytes, mlocked=self.pool.mlocked,
            step_calls_total=engine.step_calls if engine else 0,
            step_ops_total=engine.step_ops if engine else 0, rpc=self._rpc.counts,
            channels=self._channel_stats(), connections=self._connection_stats(),
            restart=self._warm.stats if self._warm is not None else RestartStats(),
            tiers=self._tier.stats() if self._tier is not None else []))

    def _channel_stats(self) -> ChannelStats:
        hub, service = self._channels, self._channel_service
        if hub is None or service is None:
            return ChannelStats(native=NATIVE, native_forced=NATIVE_FORCED)
        return ChannelStats(open=len(hub), native=NATIVE, native_forced=NATIVE_FORCED,
                            records_total=dict(sorted(service.records.items())),
                            rejected_total=service.rejected_total,
                            broken_total=hub.broken_total)

    def _connection_stats(self) -> ConnectionStats:
        """The front door's and the attach server's counts (zero before they start)."""
        door, attach = self._door, self._attach
        return ConnectionStats(
            open=door.connections if door is not None else 0,
            refused_total=door.refused_total if door is not None else 0,
            idle_closed_total=door.idle_closed_total if door is not None else 0,
            shed_total=door.shed_total if door is not None else 0,
            attach_refused_total=attach.refusals_total if attach is not None else 0)

    def request_drain(self, timeout: float | None = None,
                      answered: asyncio.Future[None] | None = None) -> bool:
        """Start draining (idempotent): False when a drain is already under way. `answered`:
        done once the caller's answer is written; the shutdown waits for it (bounded)."""
        if answered is not None and not answered.done() and len(self._answers) < MAX_OWED:
            self._answers.add(answered)
            answered.add_done_callback(self._answers.discard)
        if self._stop.is_set():
            return False
        if timeout is not None:
            self._drain_timeout = timeout
        self._stop.set()
        self._stop_prefault.set()
        return True

    # -- life cycle

    async def run(self) -> int:
        cfg = self.config
        log_summary(cfg)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        failure: StartupError | None = None
        try:
            self._lock = _prepare_socket_path(cfg.server.socket)
            await self._start()
            if not self._stop.is_set():
                assert self.pool is not None
                if cfg.pool.prefault and not self.pool.adopted and not gc.isenabled():
                    tune_gc()               # a pre-fault may take minutes: the GC runs meanwhile
                await prepare_pool(self.pool, cfg.pool, self._stop_prefault)
            if not self._stop.is_set() and self.core is not None:
                self.core.set_serving()
                await self._set_health(health_pb2.HealthCheckResponse.SERVING)
                notify.ready(f"serving {format_size(cfg.pool.size)} on {cfg.server.socket}")
                log.info("serving on %s", cfg.server.socket)
            if not gc.isenabled():
                # Once serving, and not at once: the first answers (health, engines attaching
                # again) do not wait for its collection (~20 ms).
                loop.call_later(TUNE_GC_AFTER_S, tune_gc)
            await self._stop.wait()
            await self._drain()
            return 0
        except StartupError as exc:
            failure = exc
            return 1
        finally:
            await self._shutdown()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            if failure is not None:
                # Last, after the shutdown's lines: the line an operator reads names the fix.
                log.error("%s", failure)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.request_drain():
            log.info("%s received: draining", signal.Signals(sig).name)

    async def _start(self) -> None:
        cfg = self.config
        size = (cfg.pool.size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            warm = self._warm = WarmRestart.open(cfg, size, cold=self._cold)
        except (StateError, OSError) as exc:
            # Name what is at fault: the directory, or systemd's store (restart.store), whose
            # own message names the setting.
            where = ("warm restart" if cfg.restart.store == "systemd"
                     else "restart.directory")
            raise StartupError(f"{where}: {exc}") from None
        pools = self.pools = TenantPools(cfg.pool, warm)
        try:
            if not cfg.pool.allow_overcommit and not (warm and warm.adopting):
                check_fits(cfg.pool.size)
            pool = pools.default
            if warm is not None:
                for tenant in warm.tenants_to_adopt():    # their blocks are in their files
                    pools.for_tenant(tenant)
        except (PoolError, OSError) as exc:
            raise StartupError(f"cannot create the pool: {exc}") from None
        extents = ExtentAllocator(pool.size, cfg.pool.extent_size, first_owner=DEFAULT_TENANT,
                                  on_move=pools.relocate)
        pools.extent_bytes = extents.extent_bytes
        core = self.core = KvdCore(cfg, extents)
        if warm is not None:
            core.warm = warm
            core.namespaces.files = warm
            warm.adopt(core)
        self._tier = _start_tier(cfg, core, pools)
        protocols = EngineProtocols.over(core, self._tier)
        if self._tier is not None:              # a prewarm promotes from the tiers below
            core.retention.promote = self._tier.promote
        if cfg.server.admin_token_file:
            try:
                self._tokens = AdminTokens(read_token_file(cfg.server.admin_token_file))
            except TokenFileError as exc:
                raise StartupError(f"server.admin_token_file: {exc}") from None
        metrics = self._start_metrics()
        self._rpc = RpcRecorder(metrics)

        server = grpc.aio.server(options=self._server_options())
        self._engine = EngineService(core, protocols, cfg, pool.size, self._rpc)
        kvd_pb2_grpc.add_KvdEngineServicer_to_server(self._engine, server)
        kvd_pb2_grpc.add_KvdAdminServicer_to_server(
            AdminService(core, cfg, self._rpc, self.snapshot, self.request_drain,
                         self._tokens), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if cfg.server.reflection:
            self._enable_reflection(server)
        # gRPC listens in a private directory; the public socket is the front door's.
        self._private_dir = tempfile.mkdtemp(prefix="kvd-")
        backend = os.path.join(self._private_dir, "grpc.sock")
        server.add_insecure_port(grpc_target(backend))
        await server.start()
        self._server = server
        door = FrontDoor(cfg.server.socket, cfg.server.socket_mode, backend,
                         per_uid=cfg.server.max_connections_per_uid,
                         idle_timeout=cfg.server.idle_timeout)
        try:
            await door.start()
        except OSError as exc:
            raise StartupError(_bind_problem(cfg.server.socket, exc)) from None
        self._door = door

        service = self._channel_service = ChannelService(core, protocols,
                                                         ChannelHeader().down_max_record)
        self._channels = ChannelHub(
            service, heartbeat=core.heartbeat,
            on_broken=lambda s, why: core.close_session(s, why, reaped=True))  # type: ignore
        service.send = self._channels.send
        core.on_session_end.append(self._end_channel)
        roles = AttachRoles(core, protocols.fastpath, self._tier, pools, self._tokens,
                            self._channels, self._rpc.observe_transfer)
        attach = AttachServer(cfg.server.attach_socket, cfg.server.socket_mode, roles,
                              on_exhausted=door.shed)
        try:
            await attach.start()
        except OSError as exc:
            raise StartupError(_bind_problem(cfg.server.attach_socket, exc)) from None
        self._attach = attach
        if cfg.server.admin_listen:
            await self._start_admin_listener(core)
        self._tasks.append(asyncio.create_task(self._sweeper(core), name="kvd-sweeper"))

    async def _start_admin_listener(self, core: KvdCore) -> None:
        """The optional remote admin port: KvdAdmin and health only, TLS only, every call
        with the admin token (the engine service never leaves the node)."""
        cfg = self.config.server
        try:
            cert = _read_pem(cfg.tls_cert, "server.tls_cert")
            key = _read_pem(cfg.tls_key, "server.tls_key")
            ca = _read_pem(cfg.tls_client_ca, "server.tls_client_ca") if cfg.tls_client_ca \
                else None
            creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                                require_client_auth=ca is not None)
        except (OSError, ValueError, RuntimeError) as exc:
            raise StartupError(f"cannot set up TLS for server.admin_listen: {exc}") from None
        server = grpc.aio.server(options=self._server_options())
        kvd_pb2_grpc.add_KvdAdminServicer_to_server(
            AdminService(core, self.config, self._rpc, self.snapshot, self.request_drain,
                         self._tokens, remote=True), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            port = server.add_secure_port(cfg.admin_listen, creds)
        except RuntimeError as exc:
            raise StartupError(f"cannot listen on {cfg.admin_listen}: {exc}") from None
        if not port:
            raise StartupError(f"cannot listen on {cfg.admin_listen} (address in use or "
                               "not local?)")
        await server.start()
        self._admin_server = server
        log.info("remote admin: TLS on %s%s", cfg.admin_listen,
                 " (client certificates required)" if ca else "")

    @staticmethod
    def _server_options() -> list[tuple[str, int]]:
        # Read messages up to the transport limit so that one over the stated limit is
        # answered as a bound violation (INVALID_ARGUMENT, in-band on a stream).
        return [*[o for o in channel_options() if o[0] != "grpc.max_receive_message_length"],
                ("grpc.max_receive_message_length", TRANSPORT_MESSAGE_BYTES)]

    def _start_metrics(self) -> RpcMetrics | None:
        cfg = self.config.server
        if not cfg.metrics_port:
            return None
        from kvd_server.ops import metrics

        registry, rpc_metrics = metrics.build_registry(
            metrics.on_loop(asyncio.get_running_loop(), self.snapshot))
        try:
            self._metrics_server = metrics.start_metrics(registry, cfg.metrics_address,
                                                         cfg.metrics_port)
        except OSError as exc:
            raise StartupError(f"cannot serve metrics on {cfg.metrics_address}:"
                               f"{cfg.metrics_port}: {exc.strerror or exc}; choose another "
                               "--metrics-port (server.metrics_port, 0 = off) or stop what "
                               "listens there") from None
        return rpc_metrics

    @staticmethod
    def _enable_reflection(server: grpc.aio.Server) -> None:
        try:
            from grpc_reflection.v1alpha import reflection
        except ImportError:
            log.warning("server.reflection is on but grpcio-reflection is not installed "
                        "(pip install 'kvd-offload[reflection]'); serving without reflection")
            return
        names = (kvd_pb2.DESCRIPTOR.services_by_name["KvdEngine"].full_name,
                 kvd_pb2.DESCRIPTOR.services_by_name["KvdAdmin"].full_name,
                 health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        log.info("gRPC server reflection on (services: %s)", ", ".join(names))

    async def _set_health(self, status: int) -> None:
        for name in HEALTH_SERVICES:
            await self._health.set(name, status)


    def _end_channel(self, session: Session) -> None:
        """A session ends: what its channel still holds is applied, then it goes."""
        if self._channels is not None:
            if self._channels.get(session.id) is not None:
                log.debug("channel of session %s closed; it held %d slots granted (reserve "
                          "target %d)", session.id, len(session.granted), session.reserve_target)
            self._channels.close(session.id)
            if self._channel_service is not None:
                self._channel_service.forget(session.id)

    def _log_activity(self) -> None:
        """At debug, one line about what changed since the last one (see Activity)."""
        if self.core is not None and log.isEnabledFor(logging.DEBUG):
            line = self._activity.line(self.core, self._channel_service, self._channels)
            if line:
                log.debug("%s", line)

    async def _sweeper(self, core: KvdCore) -> None:
        loop = asyncio.get_running_loop()
        next_trim = loop.time() + TRIM_INTERVAL
        next_activity = loop.time() + ACTIVITY_S
        while True:
            due = loop.time() + SWEEP_INTERVAL
            await asyncio.sleep(SWEEP_INTERVAL)
            late = loop.time() - due
            try:
                if late > SWEEP_INTERVAL:
                    # The daemon itself was not running (stopped, swapped out, a long pause):
                    # heartbeats may sit unread in socket buffers, so that silence is ours,
                    # not the engines'. Do not reap anyone for it.
                    core.forgive(late)
                core.sweep()
                if self._tier is not None:
                    self._tier.tick()
                    await self._tier.publish_health(self._health)
                if loop.time() >= next_trim and self.pools is not None:
                    next_trim = loop.time() + TRIM_INTERVAL
                    self.pools.trim(core.extents.owner)
                if loop.time() >= next_activity:
                    next_activity = loop.time() + ACTIVITY_S
                    self._log_activity()
            except Exception:  # a sweep bug must not stop liveness for every later sweep
                log.exception("sweep failed")

    async def _drain(self) -> None:
        timeout = self._drain_timeout
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        notify.stopping("draining")
        core = self.core
        if core is None:
            return
        core.start_drain()
        deadline = time.monotonic() + timeout
        pending = core.loads_in_flight()
        log.info("draining: new stores refused, %d load(s) in flight, waiting up to %s",
                 pending, format_duration(timeout))
        while pending and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL)
            pending = core.loads_in_flight()
        if pending:
            log.warning("drain timeout: %d load(s) still in flight; exiting anyway", pending)
        else:
            log.info("drained")
        self._log_activity()

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._attach is not None:
            await self._attach.close()
        if self._channels is not None:
            self._channels.close_all()
        # The Drain calls' answers are written before the door shuts, and the door forwards
        # what gRPC wrote before closing a client's end: a drain with nothing in flight is
        # over before its own answer has left (the CLI read that as "did not answer").
        if self._answers:
            await asyncio.wait(set(self._answers), timeout=STOP_GRACE)
        if self._door is not None:
            await self._door.close(linger=STOP_GRACE)
        if self._admin_server is not None:
            await self._admin_server.stop(STOP_GRACE)
        if self._server is not None:
            await self._server.stop(STOP_GRACE)
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self._tier is not None:
            # No warm restart: the pool's blocks down to the disk first (tiers.disk.flush_on_stop).
            await self._tier.write_down_at_stop(self.config)
            self._tier.close()                 # writes in flight finish, its journal synced
        if self.pools is not None:
            self.pools.close()
        if self._server is not None or self._attach is not None:
            _remove(self.config.server.socket)
            _remove(self.config.server.attach_socket)
        if self._lock is not None:
            _unlock_socket_path(self.config.server.socket, self._lock)
            self._lock = None
        log.info("kvd stopped")


async def prepare_pool(pool: HostPool, cfg: PoolConfig, stop: threading.Event) -> None:
    """Pre-fault the pool (off the event loop, with progress in the log and for systemd: a
    large pool may take minutes) unless it was adopted from the previous daemon, then lock
    it in memory where configured. `stop` ends the pre-fault early (the daemon is stopping)."""
    if cfg.prefault and pool.adopted:
        log.info("pool adopted from the previous daemon: its pages are there already, "
                 "no pre-fault")
    elif cfg.prefault:
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        last = [-1]

        def progress(done: int, total: int) -> None:
            tenth = done * 10 // max(total, 1)
            if tenth != last[0]:
                last[0] = tenth
                # Each tenth also buys systemd's start timeout some more time: the unit must
                # not be killed while it works.
                loop.call_soon_threadsafe(notify.extend_timeout, PREFAULT_EXTEND_S,
                                          f"pre-faulting the pool: {tenth * 10}%")
                log.info("pre-faulting the pool: %d%% (%s of %s)", tenth * 10,
                         format_size(done), format_size(total))

        finished = await asyncio.to_thread(pool.prefault, progress, stop)
        if not finished:
            log.info("pre-fault stopped at %s of %s", format_size(pool.prefaulted_bytes),
                     format_size(pool.size))
            return
        log.info("pool pre-faulted in %.1fs", time.monotonic() - started)
    if cfg.mlock:
        pool.mlock()  # a failure is logged by the pool; the daemon runs unlocked


class Activity:
    """What changed in the daemon between two looks, as one DEBUG line: sessions attached and
    ended, namespaces created (with their layouts) and forgotten, slots held granted, channels
    and their records by kind. Counts and names only, at most one line per ACTIVITY_S: never
    a line per key or per step, which would cost every engine on the node its latency."""

    def __init__(self) -> None:
        self.namespaces: dict[str, str] = {}     # id -> model, at the last look
        self.forgotten = 0
        self.attached = 0
        self.ended = 0
        self.granted = 0
        self.channels = 0
        self.records: Counter[str] = Counter()

    def line(self, core: KvdCore, service: ChannelService | None,
             hub: ChannelHub | None) -> str | None:
        """The line, or None when nothing changed."""
        sessions = core.sessions
        current = {ns.id: ns for ns in core.namespaces}
        created = [ns for ns_id, ns in current.items() if ns_id not in self.namespaces]
        gone = [(ns_id, model) for ns_id, model in self.namespaces.items()
                if ns_id not in current]
        forgotten = core.namespaces.forgotten_total - self.forgotten
        attached = sessions.attached_total - self.attached
        ended = sessions.closed_total + sessions.reaped_total - self.ended
        granted = sum(len(s.granted) for s in sessions)
        channels = len(hub) if hub is not None else 0
        records = Counter(service.records) if service is not None else Counter()
        new_records = records - self.records
        self.namespaces = {ns_id: ns.model for ns_id, ns in current.items()}
        self.forgotten = core.namespaces.forgotten_total
        self.attached += attached
        self.ended += ended
        self.records = records
        parts = []
        if attached or ended:
            parts.append(f"sessions {len(sessions)} live ({attached} attached, {ended} ended)")
        if created:
            parts.append("namespaces created: " + _some(
                [f"{ns.id[:12]} ({_layout(ns)})" for ns in created[:MAX_NAMED]], len(created)))
        if gone or forgotten:
            # `forgotten` also counts namespaces created and forgotten between two looks.
            parts.append("namespaces forgotten: " + _some(
                [f"{ns_id[:12]} ({model})" for ns_id, model in gone[:MAX_NAMED]],
                max(forgotten, len(gone))))
        if granted != self.granted:
            parts.append(f"slots held granted {granted} (was {self.granted})")
            self.granted = granted
        if channels != self.channels:
            parts.append(f"channels open {channels} (was {self.channels})")
            self.channels = channels
        if new_records:
            parts.append("channel records " + ", ".join(
                f"{kind} {n}" for kind, n in sorted(new_records.items())))
        return "activity: " + "; ".join(parts) if parts else None


def log_summary(cfg: Config) -> None:
    """What a starting daemon says of itself: version, pool, sockets, policy, metrics."""
    log.info("kvd %s starting (pid %d, config %s)", __version__, os.getpid(),
             cfg.source or "embedded defaults")
    if cfg.restart.warm and cfg.restart.store == "systemd":
        backing = "memfd in systemd's descriptor store (warm restart)"
    elif cfg.restart.warm:
        backing = f"file in {cfg.restart.directory} (warm restart)"
    else:
        backing = cfg.pool.backing + (f" in {cfg.pool.path}" if cfg.pool.backing == "file"
                                      else "")
    log.info("pool: %s %s, prefault=%s, mlock=%s, extents of %s",
             format_size(cfg.pool.size), backing, cfg.pool.prefault, cfg.pool.mlock,
             format_size(cfg.pool.extent_size))
    log.info("sockets: %s (gRPC), %s (attach), mode %04o", cfg.server.socket,
             cfg.server.attach_socket, cfg.server.socket_mode)
    log.info("policy %s, heartbeat %s, liveness timeout %s, max %d sessions",
             cfg.manager.policy, format_duration(cfg.manager.heartbeat_interval),
             format_duration(cfg.manager.liveness_timeout), cfg.server.max_sessions)
    log.info("metrics: %s", f"http://{cfg.server.metrics_address}:{cfg.server.metrics_port}"
             "/metrics" if cfg.server.metrics_port else "off")
    if NATIVE_FORCED:
        log.warning("the shared index's loops run in pure Python: KVD_NATIVE=0 in the "
                    "daemon's environment forces them (kvd_proto._native is built); kvd "
                    "works, more slowly per key")
    elif not NATIVE:
        log.warning("the shared index's loops run in pure Python (kvd_proto._native was "
                    "not built: no C compiler or Python headers at install); kvd works, "
                    "more slowly per key")


def _layout(ns: Namespace) -> str:
    lay = ns.layout
    return (f"model {ns.model}, tenant {ns.tenant}, block {format_size(lay.block_bytes)} = "
            f"{lay.num_ranks} x {format_size(lay.shard_bytes)}, {lay.tokens_per_block} tokens, "
            f"{lay.dtype or '?'}")


def _some(shown: list[str], total: int) -> str:
    """`shown` (the first few of `total`), and how many more."""
    more = total - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "") if shown \
        else f"{total}"


def _read_pem(path: str, key: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read(1 << 20)
    except OSError as exc:
        raise ValueError(f"{key} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{key} {path} is not a PEM file")
    return data


def _start_tier(cfg: Config, core: KvdCore, pools: TenantPools) -> TierLink | None:
    """The tiers below the pool (kvd_server/tiers/link.py's start_tier); None without one.
    Their modules load only where one is configured (start_tier's own two conditions): a
    daemon without a tier starts without them."""
    if not (cfg.tiers_disk.path or cfg.tiers_cluster.master):
        return None
    from kvd_server.tiers.link import start_tier

    return start_tier(cfg, core.namespaces, pools, asyncio.get_running_loop(),
                      refusing=lambda: core.draining)


def raise_open_files_limit() -> None:
    """Every engine holds a few descriptors of the daemon's: take the hard limit, not the
    (often 1024) soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def tune_gc() -> None:
    """Keep the cyclic GC off the request path.

    The index holds millions of long-lived objects and has no reference cycles on its hot
    paths; with the default thresholds every few thousand allocations trigger a collection and
    full collections walk the whole index (vLLM's in-process LRU paid ~7 s of GC pauses over a
    3,000-session replay). Objects that exist at start are frozen out of collection, and young
    collections run far less often. The GC is off while the daemon loads and starts (what it
    makes then lives as long as it does): this runs a second after it serves, or before a
    pre-fault.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 1000)
    gc.enable()


async def serve(config: Config, *, cold: bool = False) -> int:
    """Run a daemon until it is drained (SIGTERM/SIGINT or KvdAdmin.Drain); the exit code.
    `cold`: with restart.warm, drop what a previous daemon left instead of adopting it."""
    gc.disable()        # until the daemon serves (tune_gc): the start makes long-lived objects
    raise_open_files_limit()
    try:
        return await Daemon(config, cold=cold).run()
    finally:
        gc.enable()     # a daemon that never served (it could not start, or was stopped)
