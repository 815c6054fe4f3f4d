"""The `kvd` command: run the daemon (`serve`) and talk to a running one.

Exit codes (every subcommand):
  0  success (`health`: the daemon is SERVING)
  1  the daemon answered with an error, `health` found it NOT_SERVING, the configuration is
     invalid, or `serve` could not start
  2  the daemon could not be reached (no socket, refused, permission denied, timeout), or the
     command line is malformed

Here: the parser, the subcommands and `main`. Talking to the daemon (socket, admin token,
deadlines, failures as one line) is kvd_server/cli/admin_client.py; what a command prints,
kvd_server/cli/render.py; the exit codes and `CliError`, kvd_server/cli/errors.py.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from kvd_proto.paths import socket_lock_path
from kvd_server import __version__
from kvd_server.cli import agent_sessions
from kvd_server.cli.admin_client import AdminClient, client_socket
from kvd_server.cli.errors import EXIT_ERROR, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, CliError
from kvd_server.cli.render import message_json, render_sessions, render_stats
from kvd_server.config import Config, ConfigError, did_you_mean, load_config
from kvd_server.ops.stats import StatsSnapshot
from kvd_server.units import format_duration, parse_duration

DEFAULT_TIMEOUT = 5.0
MAX_TIMEOUT = 3600.0
DEFAULT_WAIT = 300.0    # `health --wait`: systemd's TimeoutStartSec for the shipped unit
WAIT_POLL = 0.2
TIERS = ("disk", "cluster")    # `health`: the tiers below the pool whose health it shows
NO_DAEMON_S = 5.0       # `health --wait`: how long nothing may listen with no daemon starting

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
    ("--restart-dir", "restart.directory",
     "directory of the warm-restart files, e.g. /dev/shm/kvd (restart.directory)"),
)
# serve's on/off flags: present means true.
_SERVE_SWITCHES: tuple[tuple[str, str, str], ...] = (
    ("--allow-overcommit", "pool.allow_overcommit",
     "start even if the pool exceeds the memory available (pool.allow_overcommit)"),
    ("--warm-restart", "restart.warm",
     "keep the cache across a restart of the daemon, in --restart-dir (restart.warm)"),
    ("--reflection", "server.reflection",
     "serve gRPC server reflection for grpcurl and other generic tools; needs "
     "grpcio-reflection: pip install 'kvd-offload[reflection]' (server.reflection)"),
)


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
    p.add_argument("--cold", action="store_true",
                   help="with restart.warm: start cold, dropping what a previous daemon left "
                        "in restart.directory (after a change the old files cannot serve, or "
                        "to start over)")
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
                                   "NOT_SERVING, then a line for a tier below the pool that "
                                   "is not serving, with why (the disk or cluster tier opening "
                                   "or degraded: the daemon still serves). Exit 0 SERVING, 1 "
                                   "NOT_SERVING, 2 unreachable.")
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
    agent_sessions.add_parser(sub, common)
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


# --- subcommands ---------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    config = _local_config(args)
    serve = import_daemon()
    from kvd_server.ops import logs

    logs.configure(config.server.log_level, config.server.log_format)
    try:
        import uvloop
    except ImportError:
        uvloop = None
    factory = uvloop.new_event_loop if uvloop is not None else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(serve(config, cold=args.cold))


def import_daemon() -> Callable[..., Coroutine[Any, Any, int]]:
    """The daemon's modules, loaded as `kvd serve` loads them; its `serve`.

    First, since they load numpy: numpy's BLAS would start a thread per further core that
    spins for ~0.1 s of CPU (the daemon does no linear algebra), taken from a start on a loaded
    node; an operator's own OPENBLAS_NUM_THREADS wins. And no cyclic GC while they load (tens
    of thousands of objects, every one kept): the daemon collects once it serves, freezes them
    and turns it back on (kvd_server/server.py's tune_gc)."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    gc.disable()
    from kvd_server.server import serve

    return serve


def cmd_stats(args: argparse.Namespace) -> int:
    from kvd_proto import kvd_pb2

    with AdminClient(args) as d:
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
    with AdminClient(args) as d:
        answer = d.call(d.admin.ListSessions, kvd_pb2.ListSessionsRequest(limit=args.limit))
    if args.json:
        print(json.dumps(message_json(answer)))
        return EXIT_OK
    print(render_sessions(answer, wide=args.wide))
    return EXIT_OK


def cmd_reset(args: argparse.Namespace) -> int:
    from kvd_proto import kvd_pb2

    path = args.address or client_socket(args)
    what = f"namespace {args.namespace}" if args.namespace else "every namespace"
    if not args.yes and sys.stdin.isatty():
        answer = input(f"Drop every cached block of {what} on {path}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("aborted")
            return EXIT_ERROR
    with AdminClient(args) as d:
        out = d.call(d.admin.Reset, kvd_pb2.AdminResetRequest(namespace_id=args.namespace),
                     admin=True)
    below = (f", and {out.dropped_below_blocks} held below the pool (disk or cluster tier)"
             if out.dropped_below_blocks else "")
    print(f"dropped {out.dropped_blocks} block(s) in {out.namespaces} namespace(s){below}")
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
    with AdminClient(args) as d:
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
                path = client_socket(args)
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
                if status == "SERVING":
                    _print_tiers(args)
                return EXIT_OK if status == "SERVING" else EXIT_ERROR
        time.sleep(WAIT_POLL)


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


def _health_status(args: argparse.Namespace, service: str = "") -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with AdminClient(args) as d:
        stub = health_pb2_grpc.HealthStub(d.channel)
        out = d.call(stub.Check, health_pb2.HealthCheckRequest(service=service))
    return health_pb2.HealthCheckResponse.ServingStatus.Name(out.status)


def _print_tiers(args: argparse.Namespace) -> None:
    """A tier below the pool that does not serve (opening, or degraded: a full, read-only or
    failing disk, the cluster's store failing) is named on a line of its own, with why (the
    tier's own reason, from the stats: what an operator needs first); the daemon still
    serves (exit 0)."""
    reasons: dict[str, str] | None = None
    for tier in TIERS:
        try:
            status = _health_status(args, f"kvd.tier.{tier}")
        except CliError:            # NOT_FOUND: no such tier on this daemon
            continue
        if status == "SERVING":
            continue
        if reasons is None:
            reasons = _tier_reasons(args)
        why = reasons.get(tier) or "opening, or degraded: `kvd stats` says why"
        print(f"tier {tier}: {status} ({why}; the pool serves without it)")


def _tier_reasons(args: argparse.Namespace) -> dict[str, str]:
    """Each tier's health and reason as the daemon's stats give them ("degraded: the disk is
    full ..."); empty when the stats cannot be had (over --address without an admin token:
    the line then points to `kvd stats`)."""
    from kvd_proto import kvd_pb2

    try:
        with AdminClient(args) as d:
            doc = json.loads(d.call(d.admin.Stats, kvd_pb2.StatsRequest()).json)
    except (CliError, ValueError):
        return {}
    return {t.name: f"{t.health}: {t.reason}" if t.reason else t.health
            for t in StatsSnapshot.from_dict(doc).tiers}


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

    with AdminClient(args) as d:
        out = d.call(d.admin.GetConfig, kvd_pb2.GetConfigRequest())
    print(out.json if args.json else out.toml.rstrip("\n"))
    return EXIT_OK


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
