"""The `kvd` command: run the daemon (`serve`) and talk to a running one.

Exit codes (every subcommand):
  0  success (`health`: the daemon is SERVING)
  1  the daemon answered with an error, `health` found it NOT_SERVING, the configuration is
     invalid, or `serve` could not start
  2  the daemon could not be reached (no socket, refused, permission denied, timeout), or the
     command line is malformed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvd_proto import paths
from kvd_proto.paths import (
    SOCKET_ENV,
    SocketState,
    daemon_socket_path,
    default_socket_path,
    grpc_target,
    probe_socket,
)
from kvd_proto.wire import ADMIN_TOKEN_METADATA
from kvd_server import __version__
from kvd_server.config import CONFIG_ENV, Config, ConfigError, did_you_mean, load_config
from kvd_server.stats import StatsSnapshot
from kvd_server.units import format_duration, format_size, parse_duration

if TYPE_CHECKING:
    from google.protobuf.descriptor import Descriptor
    from google.protobuf.message import Message

    from kvd_proto import kvd_pb2

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_UNREACHABLE = 2
EXIT_USAGE = 2          # a malformed command line (argparse's own code)
DEFAULT_TIMEOUT = 5.0
MAX_TIMEOUT = 3600.0
DEFAULT_WAIT = 300.0    # `health --wait`: systemd's TimeoutStartSec for the shipped unit
WAIT_POLL = 0.2
LOCK_SUFFIX = ".lock"
NO_DAEMON_S = 5.0       # `health --wait`: how long nothing may listen with no daemon starting
WIDTH = 80

# serve's flags and the config key each overrides.
_SERVE_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--pool-size", "pool.size", "pool bytes, e.g. 8GiB (pool.size)"),
    ("--pool-backing", "pool.backing", "memfd or file (pool.backing)"),
    ("--pool-path", "pool.path", "directory of a file-backed pool (pool.path)"),
    ("--extent-size", "pool.extent_size", "unit a namespace grows by (pool.extent_size)"),
    ("--policy", "manager.policy", "eviction policy: lru or arc (manager.policy)"),
    ("--liveness-timeout", "manager.liveness_timeout",
     "end a silent session after this long (manager.liveness_timeout)"),
    ("--metrics-port", "server.metrics_port", "Prometheus port, 0 = off (server.metrics_port)"),
    ("--metrics-address", "server.metrics_address",
     "address the metrics port binds (server.metrics_address)"),
    ("--log-level", "server.log_level",
     "debug, info, warning or error; applies to kvd's own lines, other libraries log "
     "warnings only (server.log_level)"),
    ("--log-format", "server.log_format",
     "text, or json: one object per line with UTC timestamps (server.log_format)"),
)
# serve's on/off flags: present means true.
_SERVE_SWITCHES: tuple[tuple[str, str, str], ...] = (
    ("--allow-overcommit", "pool.allow_overcommit",
     "start even if the pool exceeds the memory available (pool.allow_overcommit)"),
    ("--reflection", "server.reflection",
     "serve gRPC server reflection for grpcurl and other generic tools; needs "
     "grpcio-reflection: pip install 'kvd-offload[reflection]' (server.reflection)"),
)


class CliError(Exception):
    """A failure the CLI reports in one line, with its exit code. `transient`: it may go away
    by itself (no socket yet, the daemon not answering yet), so `health --wait` tries again.
    `nobody`: nothing listens on the socket path (no socket, or a dead daemon's)."""

    def __init__(self, message: str, code: int = EXIT_ERROR, *, transient: bool = False,
                 nobody: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.transient = transient
        self.nobody = nobody


# --- argument parsing ----------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that suggests the close match for a mistyped subcommand, choice or option."""

    commands: dict[str, _Parser]

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's one check of a value against `choices`, subcommand names included.
        if action.choices is not None and value not in action.choices:
            choices = [str(choice) for choice in action.choices]
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r}{did_you_mean(str(value), choices)}; "
                        f"choose from {', '.join(choices)}")

    def unrecognized(self, words: Sequence[str]) -> str:
        """argparse's complaint about `words`, with the close match of each mistyped option."""
        options = [flag for action in self._actions for flag in action.option_strings]
        hints = "".join(did_you_mean(word.split("=", 1)[0], options)
                        for word in words if word.startswith("--"))
        return f"unrecognized arguments: {' '.join(words)}{hints}"


def build_parser() -> _Parser:
    sockets = argparse.ArgumentParser(add_help=False)
    sockets.add_argument("--socket", metavar="PATH",
                         help="the daemon's gRPC socket (default: $KVD_SOCKET, $KVD_SERVER_SOCKET, "
                              "server.socket from $KVD_CONFIG, else $XDG_RUNTIME_DIR/kvd/kvd.sock "
                              "or /tmp/kvd-$UID/kvd.sock; client commands also try "
                              "/run/kvd/kvd.sock when that default does not exist)")
    timeout = argparse.ArgumentParser(add_help=False)
    timeout.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                         help=f"deadline for each call to the daemon, more than 0 and at most "
                              f"{MAX_TIMEOUT:g} (default {DEFAULT_TIMEOUT:g})")
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument("--admin-token-file", metavar="PATH",
                        default=os.environ.get("KVD_ADMIN_TOKEN_FILE") or None,
                        help="file holding the daemon's static admin token (default: "
                             "$KVD_ADMIN_TOKEN_FILE; on the Unix socket reset and drain ask the "
                             "daemon for a token instead, which works for root, the daemon's "
                             "user and server.admin_uids/admin_gids)")
    remote = client.add_argument_group(
        "remote admin", "talk to the daemon's TLS admin listener (server.admin_listen) instead "
                        "of its Unix socket; every call then needs --admin-token-file")
    remote.add_argument("--address", metavar="HOST:PORT",
                        help="the daemon's TLS admin listener")
    remote.add_argument("--tls-ca", metavar="PATH",
                        help="PEM CA bundle that signed the daemon's certificate (default: the "
                             "system's roots)")
    remote.add_argument("--tls-cert", metavar="PATH",
                        help="PEM client certificate, when the daemon requires one")
    remote.add_argument("--tls-key", metavar="PATH", help="PEM key of --tls-cert")
    settings = argparse.ArgumentParser(add_help=False)
    settings.add_argument("--config", metavar="PATH",
                          help="TOML configuration file (default: $KVD_CONFIG, else the "
                               "embedded defaults)")
    for flag, key, text in _SERVE_FLAGS:
        settings.add_argument(flag, dest=_dest(key), metavar="VALUE", help=text)
    for flag, key, text in _SERVE_SWITCHES:
        settings.add_argument(flag, dest=_dest(key), action="store_const", const=True,
                              help=text)

    parser = _Parser(
        prog="kvd",
        description="kvd: per-node KV-cache offload daemon for LLM inference engines.",
        epilog="Exit codes: 0 success; 1 error answered by the daemon, NOT_SERVING, bad "
               "configuration or failed start; 2 daemon unreachable or bad command line. "
               "Reference: docs/cli.md, docs/configuration.md.",
    )
    parser.add_argument("--version", action="version", version=f"kvd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    common = [sockets, timeout, client]
    p = sub.add_parser("serve", parents=[sockets, settings],
                       help="run the daemon in the foreground",
                       description="Run the daemon in the foreground until SIGTERM/SIGINT or "
                                   "`kvd drain`. Precedence: embedded defaults < --config file "
                                   "< KVD_<SECTION>_<KEY> env < flags. --socket sets "
                                   "server.socket. Sizes take K, M, G, T (powers of 1024: 8G = "
                                   "8Gi = 8GiB), durations ms, s, m, h.")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("stats", parents=common, help="show the daemon's statistics",
                       description="Grouped statistics (server, pool, blocks, sessions, "
                                   "stats, tenants, namespaces, rpc) with human units.")
    p.add_argument("--json", action="store_true",
                   help="print the stats document verbatim as one JSON object")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("sessions", parents=common, help="list the attached engine sessions",
                       description="List the live engine sessions.")
    p.add_argument("--limit", type=int, default=1000, help="at most this many (default 1000)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--wide", action="store_true",
                   help="print ids, tenants and models whole (lines may pass 80 columns)")
    p.set_defaults(func=cmd_sessions)

    p = sub.add_parser("reset", parents=common, help="drop cached blocks",
                       description="Drop every ready block (of all namespaces, or one) and bump "
                                   "the epochs. Loads and stores in flight finish harmlessly. "
                                   "Asks for confirmation on a terminal unless --yes. Needs "
                                   "admin permission: root, the daemon's user, "
                                   "server.admin_uids/admin_gids, or --admin-token-file.")
    p.add_argument("--namespace", metavar="ID", default="", help="only this namespace id")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=cmd_reset)

    p = sub.add_parser("drain", parents=common, help="drain the daemon and make it exit",
                       description="Health NOT_SERVING, new stores refused, loads in flight "
                                   "finish (up to the drain timeout), then the daemon exits 0. "
                                   "Needs admin permission, as reset does.")
    p.add_argument("--drain-timeout", metavar="DURATION", default=None,
                   help="wait at most this long for loads in flight (default: "
                        "server.drain_timeout of the daemon)")
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser("health", parents=common, help="check whether the daemon serves",
                       description="Query the standard gRPC health service. Prints SERVING or "
                                   "NOT_SERVING. Exit 0 SERVING, 1 NOT_SERVING, 2 unreachable.")
    p.add_argument("--wait", nargs="?", type=_wait, const=DEFAULT_WAIT, metavar="TIMEOUT",
                   help="wait until the daemon serves (it answers NOT_SERVING while it "
                        "pre-faults its pool, and has no socket before it starts), at most "
                        f"TIMEOUT (default {format_duration(DEFAULT_WAIT)}; e.g. 90s, 2m); "
                        "then as without --wait. Gives up sooner (exit 2) when no daemon is "
                        "coming: nothing listening and no process holding the socket's lock "
                        f"for {NO_DAEMON_S:g}s")
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("config", parents=[*common, settings], help="show the effective config",
                       description="Print the running daemon's effective configuration as "
                                   "TOML; with --local, what `kvd serve` with the same flags "
                                   "and environment would use (no daemon needed). The serve "
                                   "flags (--config, --pool-size, ...) need --local.")
    p.add_argument("--local", action="store_true", help="resolve locally instead of asking")
    p.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    p.set_defaults(func=cmd_config)
    parser.commands = sub.choices
    return parser


def _dest(key: str) -> str:
    return "set_" + key.replace(".", "_")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= MAX_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be more than 0 and at most {MAX_TIMEOUT:g} seconds")
    return value


def _wait(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _setting_flags(args: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    """The serve flags given on this command line, as config overrides."""
    overrides: dict[str, tuple[Any, str]] = {}
    for flag, key, _ in _SERVE_FLAGS + _SERVE_SWITCHES:
        value = getattr(args, _dest(key), None)
        if value is not None:
            overrides[key] = (value, f"flag {flag}")
    return overrides


def _local_config(args: argparse.Namespace) -> Config:
    overrides = _setting_flags(args)
    if args.socket:
        overrides["server.socket"] = (args.socket, "flag --socket")
    return load_config(args.config, overrides=overrides)


def _client_socket(args: argparse.Namespace) -> str:
    """The socket a client subcommand talks to: --socket, $KVD_SOCKET or $KVD_SERVER_SOCKET,
    $KVD_CONFIG's server.socket, else the client rule (kvd_proto.paths.default_socket_path:
    the user's default, or /run/kvd/kvd.sock when only that one exists)."""
    if args.socket:
        return os.path.abspath(args.socket)
    if os.environ.get(CONFIG_ENV) and not any(os.environ.get(name) for name in SOCKET_ENV):
        try:
            configured = load_config().server.socket
        except ConfigError:
            configured = ""
        if configured and configured != daemon_socket_path():
            return configured
    return default_socket_path()


# --- talking to the daemon -----------------------------------------------------------------


class _Daemon:
    """A short-lived channel to the daemon with one-line errors instead of tracebacks.

    Over the Unix socket, `admin=True` calls (reset, drain) carry an admin token: read from
    --admin-token-file, else asked for on the attach socket. Over --address (TLS) every call
    carries the token from --admin-token-file.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        import grpc

        from kvd_proto import kvd_pb2_grpc

        self._grpc = grpc
        self.timeout = args.timeout
        self._token_file = args.admin_token_file
        self._token: str | None = None
        self.remote = bool(getattr(args, "address", None))
        self._client_cert = bool(getattr(args, "tls_cert", None))
        if self.remote:
            self.path = args.address
            if not self._token_file:
                raise CliError("--address needs --admin-token-file (the remote listener "
                               "answers only admin-token holders)", EXIT_UNREACHABLE)
            self.channel = grpc.secure_channel(args.address, _tls_credentials(args))
        else:
            self.path = _client_socket(args)
            _probe(self.path)
            self.channel = grpc.insecure_channel(grpc_target(self.path))
        self.admin = kvd_pb2_grpc.KvdAdminStub(self.channel)

    def admin_token(self) -> str:
        if self._token is None:
            from kvd_proto.attach import AttachError, request_admin_token
            from kvd_server.admin_tokens import TokenFileError, read_token_file

            if self._token_file:
                try:
                    self._token = read_token_file(self._token_file)
                except TokenFileError as exc:
                    raise CliError(f"--admin-token-file: {exc}") from None
            else:
                try:
                    self._token = request_admin_token(self.path, self.timeout)
                except AttachError as exc:
                    if exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                        raise CliError(f"the daemon at {self.path} did not answer on its "
                                       f"attach socket ({exc.code}: {exc}); is it running? "
                                       "(its log, `systemctl status kvd`)", EXIT_UNREACHABLE,
                                       transient=True) from None
                    raise CliError(f"no admin permission: {exc.code}: {exc} (pass "
                                   "--admin-token-file, or run as root, the daemon's user or "
                                   "one of server.admin_uids/admin_gids)") from None
        return self._token

    def call(self, method: Callable[..., Any], request: Any, *, admin: bool = False) -> Any:
        metadata = ()
        if admin or self.remote:
            metadata = ((ADMIN_TOKEN_METADATA, self.admin_token()),)
        try:
            return method(request, timeout=self.timeout, metadata=metadata)
        except self._grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code not in (self._grpc.StatusCode.UNAVAILABLE,
                            self._grpc.StatusCode.DEADLINE_EXCEEDED):
                raise CliError(f"the daemon refused: {code.name}: {details}") from None
            if not self.remote:
                raise CliError(f"the daemon at {self.path} did not answer ({code.name}: "
                               f"{details}); is it running? (its log, `systemctl status kvd`)",
                               EXIT_UNREACHABLE, transient=True) from None
            problem = _tls_problem(details, self._client_cert)
            if problem:
                raise CliError(f"{self.path}: {problem}", EXIT_UNREACHABLE) from None
            reason = details.rsplit(": ", 1)[-1].rstrip(".") or code.name
            raise CliError(f"no answer from {self.path} ({reason}): is the daemon's "
                           "server.admin_listen on this address, and the port reachable?",
                           EXIT_UNREACHABLE, transient=True) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> _Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tls_credentials(args: argparse.Namespace) -> Any:
    import grpc

    def read(path: str | None, flag: str) -> bytes | None:
        if not path:
            return None
        try:
            with open(path, "rb") as fh:
                return fh.read(1 << 20)
        except OSError as exc:
            raise CliError(f"{flag} {path}: {exc.strerror or exc}", EXIT_UNREACHABLE) from None

    if bool(args.tls_cert) != bool(args.tls_key):
        raise CliError("--tls-cert and --tls-key go together", EXIT_UNREACHABLE)
    return grpc.ssl_channel_credentials(read(args.tls_ca, "--tls-ca"),
                                        read(args.tls_key, "--tls-key"),
                                        read(args.tls_cert, "--tls-cert"))


# gRPC reports a failed TLS handshake as UNAVAILABLE with the TLS library's words in the
# details; these name the usual causes, most specific first.
_TLS_PROBLEMS: tuple[tuple[str, str], ...] = (
    ("CERTIFICATE_VERIFY_FAILED", "the daemon's certificate is not trusted: pass --tls-ca "
                                  "CA.pem, the CA that signed it"),
    ("Hostname Verification", "the daemon's certificate does not name this host: connect by "
                              "a name or address the certificate holds"),
    ("WRONG_VERSION_NUMBER", "this port does not speak TLS: is it the daemon's "
                             "server.admin_listen?"),
)


def _tls_problem(details: str, client_cert: bool) -> str | None:
    """One line for a TLS failure in gRPC's error text, or None when it is not one."""
    for marker, message in _TLS_PROBLEMS:
        if marker in details:
            return message
    if details.endswith("Socket closed"):
        # What a daemon that requires client certificates does to a client without a good one.
        return ("the daemon closed the connection: is your certificate signed by its "
                "server.tls_client_ca?" if client_cert else
                "the daemon closed the connection: if it requires client certificates "
                "(server.tls_client_ca), pass --tls-cert and --tls-key")
    if "handshake" in details.lower() or "SSL_ERROR" in details:
        reason = details.rsplit("OPENSSL_internal:", 1)[-1] if "OPENSSL_internal:" in details \
            else details.rsplit(": ", 1)[-1]
        return f"TLS handshake failed: {reason.strip()}"
    return None


def _probe(path: str) -> None:
    """Connect once with a plain socket to turn the usual mistakes into clear messages."""
    state, detail = probe_socket(path, timeout=2.0)
    if state is SocketState.LIVE:
        return
    if state is SocketState.ABSENT:
        raise CliError(f"no kvd daemon socket at {path}: start one with `kvd serve` or pass "
                       "--socket PATH", EXIT_UNREACHABLE, transient=True, nobody=True)
    if state in (SocketState.DENIED, SocketState.ERROR):
        closed = closed_directory(path)
        if closed:
            raise CliError(f"permission denied on {path}: {closed}", EXIT_UNREACHABLE)
    if state is SocketState.DENIED:
        raise CliError(f"permission denied on {path}: run as the daemon's user or a member of "
                       "the socket's group", EXIT_UNREACHABLE)
    if state is SocketState.STALE:
        raise CliError(f"nothing is listening on {path} (a stale socket?): start the daemon "
                       "with `kvd serve`", EXIT_UNREACHABLE, transient=True, nobody=True)
    raise CliError(f"cannot connect to {path}: {detail}", EXIT_UNREACHABLE)


def closed_directory(path: str) -> str | None:
    """Why this user cannot reach `path` when a directory on the way is the reason."""
    return paths.closed_directory(path, "run as its owner or a member of group {group}, or "
                                        "ask for a socket directory you may enter")


# --- subcommands ---------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    config = _local_config(args)
    from kvd_server import logs
    from kvd_server.server import serve

    logs.configure(config.server.log_level, config.server.log_format)
    try:
        import uvloop
    except ImportError:
        uvloop = None
    factory = uvloop.new_event_loop if uvloop is not None else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(serve(config))


def cmd_stats(args: argparse.Namespace) -> int:
    from kvd_proto import kvd_pb2

    with _Daemon(args) as d:
        text = d.call(d.admin.Stats, kvd_pb2.StatsRequest()).json
    if args.json:
        print(text)
    else:
        print(render_stats(StatsSnapshot.from_dict(json.loads(text))))
    return EXIT_OK


def cmd_sessions(args: argparse.Namespace) -> int:
    from kvd_proto import kvd_pb2

    if not 0 < args.limit <= 10000:
        raise CliError("--limit must be within 1..10000", EXIT_USAGE)
    with _Daemon(args) as d:
        answer = d.call(d.admin.ListSessions, kvd_pb2.ListSessionsRequest(limit=args.limit))
    if args.json:
        print(json.dumps(message_json(answer)))
        return EXIT_OK
    print(render_sessions(answer, wide=args.wide))
    return EXIT_OK


def message_json(message: Message) -> dict[str, Any]:
    """A protobuf message as a JSON-ready dict with the proto's field names and 64-bit integers
    as numbers (the proto3 JSON mapping writes them as strings, which `jq` cannot add up)."""
    from google.protobuf import json_format

    doc = json_format.MessageToDict(message, preserving_proto_field_name=True,
                                    always_print_fields_with_no_presence=True)
    _int64_as_numbers(message.DESCRIPTOR, doc)
    return doc


def _int64_as_numbers(descriptor: Descriptor, doc: dict[str, Any]) -> None:
    from google.protobuf.descriptor import FieldDescriptor

    wide = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
            FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}
    for field in descriptor.fields:
        value = doc.get(field.name)
        if value is None:
            continue
        items = value if isinstance(value, list) else [value]
        if field.type in wide:
            numbers = [int(item) for item in items]
            doc[field.name] = numbers if isinstance(value, list) else numbers[0]
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for item in items:
                _int64_as_numbers(field.message_type, item)


def cmd_reset(args: argparse.Namespace) -> int:
    from kvd_proto import kvd_pb2

    path = args.address or _client_socket(args)
    what = f"namespace {args.namespace}" if args.namespace else "every namespace"
    if not args.yes and sys.stdin.isatty():
        answer = input(f"Drop every cached block of {what} on {path}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("aborted")
            return EXIT_ERROR
    with _Daemon(args) as d:
        out = d.call(d.admin.Reset, kvd_pb2.AdminResetRequest(namespace_id=args.namespace),
                     admin=True)
    print(f"dropped {out.dropped_blocks} block(s) in {out.namespaces} namespace(s)")
    return EXIT_OK


def cmd_drain(args: argparse.Namespace) -> int:
    from kvd_proto import kvd_pb2
    from kvd_server.units import parse_duration

    timeout_ms = 0
    if args.drain_timeout is not None:
        try:
            timeout_ms = max(1, round(parse_duration(args.drain_timeout) * 1000))
        except ValueError as exc:
            raise CliError(f"--drain-timeout: {exc}", EXIT_USAGE) from None
    with _Daemon(args) as d:
        out = d.call(d.admin.Drain, kvd_pb2.DrainRequest(timeout_ms=timeout_ms), admin=True)
    print("draining: the daemon exits once loads in flight finish" if out.started
          else "a drain was already under way")
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    """Ask once; with --wait, ask again every WAIT_POLL seconds while the answer is
    NOT_SERVING or the daemon is not there yet, until SERVING or the wait is over. The wait
    ends early when no daemon is coming: nothing has listened on the socket and no process
    has held its lock (a starting daemon takes it first) for NO_DAEMON_S."""
    deadline = None if args.wait is None else time.monotonic() + args.wait
    nobody_since: float | None = None
    while True:
        try:
            status = _health_status(args)
        except CliError as exc:
            if deadline is None or not exc.transient or time.monotonic() >= deadline:
                raise
            if not exc.nobody or args.address:
                nobody_since = None
            else:
                path = _client_socket(args)
                if _daemon_holds(path):
                    nobody_since = None
                elif nobody_since is None:
                    nobody_since = time.monotonic()
                elif time.monotonic() - nobody_since >= NO_DAEMON_S:
                    raise CliError(
                        f"no kvd daemon is serving or starting at {path}: nothing has listened "
                        f"there and no process has held its lock for {NO_DAEMON_S:g}s; start "
                        "one with `kvd serve` (if one was started, its log or `systemctl "
                        "status kvd` says why it stopped)", EXIT_UNREACHABLE) from None
        else:
            if status == "SERVING" or deadline is None or time.monotonic() >= deadline:
                print(status)
                return EXIT_OK if status == "SERVING" else EXIT_ERROR
        time.sleep(WAIT_POLL)


def socket_lock_path(path: str) -> str:
    """The file a daemon holds locked (flock) for its socket path from before it binds until
    it exits: a second daemon is refused even while the first is starting, and `health
    --wait` tells a daemon still starting from none at all. (Beside the sockets, like
    kvd_proto.paths.attach_path; here so that client commands need not load the daemon.)"""
    return path + LOCK_SUFFIX


def _daemon_holds(path: str) -> bool:
    """Whether a process holds the lock of socket path `path` (a daemon starting or serving
    there). Tested with a shared flock held for a moment (the daemon's exclusive one retries
    past it); a lock file this user cannot open counts as held: it cannot tell."""
    import fcntl

    try:
        fd = os.open(socket_lock_path(path), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:     # BlockingIOError: held
        return True
    finally:
        os.close(fd)     # closing lets a shared lock we took go
    return False


def _health_status(args: argparse.Namespace) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _Daemon(args) as d:
        stub = health_pb2_grpc.HealthStub(d.channel)
        out = d.call(stub.Check, health_pb2.HealthCheckRequest(service=""))
    return health_pb2.HealthCheckResponse.ServingStatus.Name(out.status)


def cmd_config(args: argparse.Namespace) -> int:
    if not args.local:
        given = [flag for _, flag in _setting_flags(args).values()]
        if args.config:
            given.insert(0, "flag --config")
        if given:
            raise CliError(f"{given[0].removeprefix('flag ')} needs --local: without it, kvd "
                           "config prints the running daemon's configuration, which flags do "
                           "not change", EXIT_USAGE)
    if args.local:
        config = _local_config(args)
        print(config.to_json() if args.json else config.to_toml(), end="")
        if args.json:
            print()
        return EXIT_OK
    from kvd_proto import kvd_pb2

    with _Daemon(args) as d:
        out = d.call(d.admin.GetConfig, kvd_pb2.GetConfigRequest())
    print(out.json if args.json else out.toml.rstrip("\n"))
    return EXIT_OK


# --- rendering -----------------------------------------------------------------------------


def _rows(title: str, rows: Sequence[tuple[str, Any]]) -> list[str]:
    out = [f"# {title}"]
    out += [f"{name:<24}{_cut(str(value), WIDTH - 24)}" for name, value in rows]
    return out


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _uptime(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m {secs}s"
    return f"{minutes}m {secs}s" if minutes else f"{secs}s"


def render_stats(snap: StatsSnapshot) -> str:
    """The stats snapshot as grouped, aligned sections that fit 80 columns."""
    server, pool, blocks = snap.server, snap.pool, snap.blocks
    totals, transfers, clients = snap.stats, snap.transfers, snap.clients
    lines = _rows("server", [
        ("version", server.version or "?"),
        ("state", server.state or "?"),
        ("pid", server.pid or "?"),
        ("uptime", _uptime(server.uptime_seconds)),
        ("socket", server.socket or "?"),
        ("attach_socket", server.attach_socket or "?"),
        ("policy", server.policy or "?"),
    ])
    total = pool.total_bytes
    lines += [""] + _rows("pool", [
        ("total", format_size(total)),
        ("used", f"{format_size(pool.used_bytes)} ({_pct(pool.used_bytes, total)})"),
        ("free", format_size(pool.free_bytes)),
        ("backing", (pool.backing or "?") + (f" {pool.path}" if pool.path else "")),
        ("extents", f"{pool.extents_total - pool.extents_free} used of {pool.extents_total} "
                    f"({format_size(pool.extent_bytes)} each)"),
        ("prefaulted", f"{format_size(pool.prefault_bytes_done)} "
                       f"({_pct(pool.prefault_bytes_done, total)})"),
        ("mlocked", "yes" if pool.mlocked else "no"),
    ])
    lines += [""] + _rows("blocks", [
        ("ready", blocks.ready),
        ("storing", blocks.storing),
        ("pinned (load or lease)", blocks.pinned),
        ("zombie", blocks.zombie),
        ("total", blocks.total),
    ])
    lines += [""] + _rows("sessions", [
        ("live", snap.sessions),
        ("attached_total", clients.attached_total),
        ("closed_total", clients.closed_total),
        ("reaped_total", clients.reaped_total),
    ])
    lookups = totals.lookups_total
    lines += [""] + _rows("stats", [
        ("lookups_total", lookups),
        ("hits_total", f"{totals.hits_total} ({_pct(totals.hits_total, lookups)})"),
        ("misses_total", totals.misses_total),
        ("stores", f"{totals.stores_started_total} started, "
                   f"{totals.stores_completed_total} completed, "
                   f"{totals.stores_failed_total} failed"),
        ("evictions_total", totals.evictions_total),
        ("store_rejections_total", totals.store_rejections_total),
        ("events_dropped_total", totals.events_dropped_total),
        ("load pins", totals.pins),
        ("lookup leases", totals.leases),
        ("resets_total", totals.resets_total),
        ("step calls / ops", f"{totals.step_calls_total} / {totals.step_ops_total}"),
        ("loaded", f"{format_size(transfers.load_bytes_total)} in "
                   f"{transfers.load_seconds_total:.2f}s"),
        ("stored", f"{format_size(transfers.store_bytes_total)} in "
                   f"{transfers.store_seconds_total:.2f}s"),
    ])
    channels = snap.channels
    records = sum(channels.records_total.values())
    lines += [""] + _rows("channels", [
        ("open", channels.open),
        ("records_total", f"{records} ({channels.rejected_total} refused)"),
        ("broken_total", channels.broken_total),
        ("index loops", "compiled" if channels.native else "pure Python (no C compiler at "
                                                            "install: slower)"),
    ])
    if snap.tenants:
        lines += [""] + _rows("tenants", [
            (_cut(name, 21), f"{format_size(t.used_bytes)} of "
                             + (format_size(t.quota_bytes) if t.quota_bytes
                                else "the pool (no quota)"))
            for name, t in sorted(snap.tenants.items())[:32]])
    lines += ["", f"# namespaces ({len(snap.namespaces)})"]
    for ns in snap.namespaces:
        # The full id on its own line: `kvd reset --namespace ID` takes it.
        b = ns.blocks
        lines.append(_cut(f"{ns.id}  {ns.model}", WIDTH))
        lines.append(_cut(
            f"    tenant {ns.tenant}, slot {format_size(ns.slot_bytes)}, "
            f"ready {b.ready}, pinned {b.pinned}, storing {b.storing}, hits "
            f"{_pct(ns.hits_total, ns.lookups_total)}, epoch {ns.epoch}", WIDTH))
        if ns.events_dropped_total:
            lines.append(f"    events_dropped_total {ns.events_dropped_total} (nobody takes "
                         "its events in time)")
        holder = ns.reclaim_holder
        if holder.session_id:
            lines.append(_cut(_holder_line(holder.session_id, holder.pid, holder.live,
                                           holder.held_seconds, holder.slots_waiting), WIDTH))
    lines += ["", "# rpc"]
    if snap.rpc:
        lines.append(f"{'method':<22}{'calls':>12}{'errors':>12}")
        for method, c in sorted(snap.rpc.items()):
            lines.append(f"{_cut(method, 21):<22}{c.calls_total:>12}{c.errors_total:>12}")
    return "\n".join(lines)


def _holder_line(session_id: str, pid: int, live: bool, seconds: float, slots: int) -> str:
    """Who holds back the reuse of a namespace's freed slots (its id and pid first: a cut
    line still names it)."""
    who = "session" if live else "ended session"
    return (f"    reuse held by {who} {session_id} (pid {pid}) for {_uptime(seconds)}: "
            f"{slots} freed slots wait")


# `kvd sessions` columns: header, width within 80 columns, right-aligned.
_SESSION_COLUMNS = (("session", 13, False), ("tenant", 10, False), ("pid", 7, True),
                    ("uid", 6, True), ("model", 20, False), ("pins", 4, True),
                    ("stores", 6, True), ("idle", 7, True))


def render_sessions(answer: kvd_pb2.ListSessionsResponse, wide: bool = False) -> str:
    """One row per session; `wide`: every cell whole (columns as wide as their widest cell)
    instead of cut to fit 80 columns."""
    rows = [(s.session_id, s.tenant, str(s.peer_pid), str(s.peer_uid), s.model or "-",
             str(s.pins), str(s.pending_stores), format_duration(round(s.idle_seconds, 1)))
            for s in answer.sessions]
    header = tuple(name for name, _, _ in _SESSION_COLUMNS)
    widths = [max(len(row[i]) for row in (header, *rows)) if wide else width
              for i, (_, width, _) in enumerate(_SESSION_COLUMNS)]
    lines = []
    for row in (header, *rows):
        cells = [_cut(cell, width) for cell, width in zip(row, widths, strict=True)]
        lines.append(" ".join(
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, (_, _, right) in zip(cells, widths, _SESSION_COLUMNS, strict=True)
        ).rstrip())
    lines.append(f"{answer.total} session(s)")
    for h in answer.reclaim_holders:
        lines.append(f"namespace {h.namespace_id}:")
        line = _holder_line(h.session_id, h.pid, h.live, h.held_seconds, h.slots_waiting)
        lines.append(line if wide else _cut(line, WIDTH))
    return "\n".join(lines)


# --- entry point ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            command = parser.commands[args.command]
            command.error(command.unrecognized(extra))
    except SystemExit as exc:  # --help, --version, usage errors: argparse's own exit code
        return int(exc.code or 0) if isinstance(exc.code, int) else EXIT_USAGE
    if args.command != "serve":
        # gRPC's C core prints its own line for a failed TLS handshake; client commands say
        # what went wrong in one line of their own (a GRPC_VERBOSITY the user set still wins).
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"kvd: configuration error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except CliError as exc:
        print(f"kvd: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvd stats | head`
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
