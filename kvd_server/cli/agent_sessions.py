"""`kvd session list|show|release|prewarm`: agent sessions' retained blocks (docs/agents.md).

Scoped to the caller's tenant by default: the CLI asks the attach socket for a tenant token
(the daemon decides the tenant from SO_PEERCRED) and the daemon answers with that tenant's
sessions alone. `--tenant NAME` or `--all-tenants` ask for others' (an operator's view) and
need admin permission, as `kvd reset` does.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvd_server.cli.admin_client import AdminClient
from kvd_server.cli.errors import EXIT_ERROR, EXIT_OK, EXIT_USAGE, CliError
from kvd_server.cli.render import message_json
from kvd_server.units import format_duration, format_size

MAX_LIMIT = 10000


def add_parser(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """The `session` command and its actions."""
    p = sub.add_parser("session", help="agent sessions' retained blocks",
                       description="Agent sessions: the blocks requests' retention hints "
                                   "keep in the pool, by the session their hints named "
                                   "(docs/agents.md). Your own tenant's by default (decided "
                                   "by the daemon from your uid); --tenant and --all-tenants "
                                   "need admin permission.")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    scope = argparse.ArgumentParser(add_help=False)
    scope.add_argument("--tenant", metavar="NAME", default="",
                       help="another tenant's sessions (admin permission)")
    scope.add_argument("--all-tenants", action="store_true",
                       help="every tenant's sessions (admin permission)")
    a = actions.add_parser("list", parents=[*common, scope],
                           help="list the sessions that retain blocks",
                           description="One row per session and namespace: retained blocks "
                                       "and bytes, and when the last of its hints runs out.")
    a.add_argument("--limit", type=int, default=1000, help="at most this many rows (1..10000)")
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(func=cmd_list)
    a = actions.add_parser("show", parents=[*common, scope], help="one session's blocks",
                           description="The session's retained blocks per namespace; exit 1 "
                                       "when it retains none.")
    a.add_argument("session", help="the session tag its hints named")
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(func=cmd_show)
    a = actions.add_parser("release", parents=[*common, scope],
                           help="drop a session's retention now",
                           description="The session's blocks stop being retained at once: "
                                       "they stay cached and are evicted as any other block.")
    a.add_argument("session", help="the session tag its hints named")
    a.set_defaults(func=cmd_release)
    a = actions.add_parser("prewarm", parents=[*common, scope],
                           help="bring a session's blocks back into the pool",
                           description="Before the session's next turn: its blocks the disk or "
                                       "cluster tier holds are promoted into the pool (a HIT, "
                                       "not a HIT_PENDING, at that turn) and those in the pool "
                                       "retained again, all for --retain. With --key, those "
                                       "keys (hex) instead of the session's own blocks.")
    a.add_argument("session", nargs="?", default="",
                   help="the session tag its hints named (optional with --key)")
    a.add_argument("--key", action="append", default=[], metavar="HEX",
                   help="a block key (hex) to prewarm instead; repeat for more (at most 4096)")
    a.add_argument("--namespace", metavar="ID", default="", help="only this namespace id")
    a.add_argument("--retain", metavar="DURATION", default="",
                   help="how long to retain them (default: the daemon's retention.default_s)")
    a.set_defaults(func=cmd_prewarm)


def _scope(args: argparse.Namespace) -> tuple[str, bool]:
    """(tenant asked, whether the admin token is needed)."""
    if args.tenant and args.all_tenants:
        raise CliError("--tenant and --all-tenants exclude each other", EXIT_USAGE)
    return args.tenant, bool(args.tenant or args.all_tenants)


def _rows(answer: Any) -> list[dict[str, Any]]:
    return [message_json(s) for s in answer.sessions]


def render(answer: Any, show_tenant: bool) -> str:
    """The listing as a table (80 columns)."""
    if not answer.sessions:
        return "no agent session retains blocks"
    head = f"{'SESSION':<24} {'TENANT':<12} " if show_tenant else f"{'SESSION':<37} "
    lines = [head + f"{'MODEL':<12} {'RETAINED':>8} {'BYTES':>8} {'BELOW':>6} {'EXPIRES':>6}"]
    for s in answer.sessions:
        tag = s.session or "(none)"
        name = f"{tag[:24]:<24} {s.tenant[:12]:<12} " if show_tenant else f"{tag[:37]:<37} "
        expires = format_duration(round(s.expires_in_seconds)) if s.retained_blocks else "-"
        lines.append(name + f"{s.model[:12]:<12} {s.retained_blocks:>8} "
                            f"{format_size(s.retained_bytes):>8} {s.below_blocks:>6} "
                            f"{expires:>6}")
    return "\n".join(lines)


def _list(args: argparse.Namespace, session: str, limit: int) -> tuple[Any, bool]:
    from kvd_proto import kvd_pb2

    tenant, admin = _scope(args)
    with AdminClient(args) as d:
        answer = d.call(d.admin.ListAgentSessions,
                        kvd_pb2.ListAgentSessionsRequest(session=session, tenant=tenant,
                                                         limit=limit),
                        admin=admin, tenant=not admin)
    return answer, admin


def cmd_list(args: argparse.Namespace) -> int:
    if not 0 < args.limit <= MAX_LIMIT:
        raise CliError(f"--limit must be within 1..{MAX_LIMIT}", EXIT_USAGE)
    answer, admin = _list(args, "", args.limit)
    if args.json:
        print(json.dumps({"tenant": answer.tenant, "sessions": _rows(answer)}))
    else:
        print(render(answer, show_tenant=admin))
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    answer, admin = _list(args, args.session, MAX_LIMIT)
    if args.json:
        print(json.dumps({"tenant": answer.tenant, "session": args.session,
                          "namespaces": _rows(answer)}))
    elif answer.sessions:
        blocks = sum(s.retained_blocks for s in answer.sessions)
        below = sum(s.below_blocks for s in answer.sessions)
        size = sum(s.retained_bytes for s in answer.sessions)
        print(f"session {args.session!r}: {blocks} retained block(s), {format_size(size)}, "
              f"{below} below the pool, in {len(answer.sessions)} namespace(s)")
        for s in answer.sessions:
            who = f" tenant {s.tenant}" if admin else ""
            expires = (f", expires in {format_duration(round(s.expires_in_seconds))}"
                       if s.retained_blocks else "")
            print(f"  {s.namespace_id}{who} ({s.model}): {s.retained_blocks} retained "
                  f"({format_size(s.retained_bytes)}){expires}; {s.tagged_blocks} in the pool "
                  f"with its tag, {s.below_blocks} below the pool")
    else:
        print(f"session {args.session!r} retains no block")
    return EXIT_OK if answer.sessions else EXIT_ERROR


def cmd_release(args: argparse.Namespace) -> int:
    from kvd_proto import kvd_pb2

    tenant, admin = _scope(args)
    with AdminClient(args) as d:
        out = d.call(d.admin.ReleaseAgentSession,
                     kvd_pb2.ReleaseAgentSessionRequest(session=args.session, tenant=tenant),
                     admin=admin, tenant=not admin)
    print(f"released session {args.session!r}: {out.released_blocks} block(s) in "
          f"{out.namespaces} namespace(s) retained no more")
    return EXIT_OK


def cmd_prewarm(args: argparse.Namespace) -> int:
    from kvd_proto import kvd_pb2
    from kvd_server.units import parse_duration

    if not args.session and not args.key:
        raise CliError("name a session, or --key to prewarm", EXIT_USAGE)
    try:
        keys = [bytes.fromhex(k) for k in args.key]
    except ValueError:
        raise CliError("--key takes a key in hex (e.g. 0a1b2c...)", EXIT_USAGE) from None
    retain_ms = 0
    if args.retain:
        try:
            retain_ms = max(1, round(parse_duration(args.retain) * 1000))
        except ValueError as exc:
            raise CliError(f"--retain: {exc}", EXIT_USAGE) from None
    tenant, admin = _scope(args)
    with AdminClient(args) as d:
        out = d.call(d.admin.PrewarmAgentSession,
                     kvd_pb2.PrewarmAgentSessionRequest(
                         session=args.session, tenant=tenant, keys=keys,
                         namespace_id=args.namespace, retain_ms=retain_ms),
                     admin=admin, tenant=not admin)
    what = f"session {args.session!r}" if args.session else f"{len(keys)} key(s)"
    print(f"prewarmed {what}: {out.promoting_blocks} block(s) being promoted into the pool, "
          f"{out.in_pool_blocks} in it already, in {out.namespaces} namespace(s)")
    return EXIT_OK
