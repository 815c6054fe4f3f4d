"""The daemon's answers as `kvd` prints them: the stats snapshot as grouped sections within 80
columns (a long value, such as why a tier is degraded, wrapped over lines, never cut: it is
what an operator came for), the session list as a table (cut to 80 columns unless --wide),
protobuf answers as JSON for `--json`. No I/O and no daemon to talk to, so each is tested
alone."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvd_server.units import format_duration, format_size

if TYPE_CHECKING:
    from google.protobuf.descriptor import Descriptor
    from google.protobuf.message import Message

    from kvd_proto import kvd_pb2
    from kvd_server.ops.stats import ConnectionStats, RestartStats, StatsSnapshot, TierStats

WIDTH = 80
NAME_WIDTH = 24          # a row's name column; its value wraps within the rest


def _rows(title: str, rows: Sequence[tuple[str, Any]]) -> list[str]:
    """A section: each row's name, then its value whole, wrapped within the value column (a
    name too long for its column gets a line of its own)."""
    out = [f"# {title}"]
    for name, value in rows:
        lines = _wrap(str(value), WIDTH - NAME_WIDTH)
        if len(name) >= NAME_WIDTH:
            out.append(name)
            out += [" " * NAME_WIDTH + line for line in lines]
            continue
        out.append(f"{name:<{NAME_WIDTH}}{lines[0]}".rstrip())
        out += [" " * NAME_WIDTH + line for line in lines[1:]]
    return out


def _wrap(text: str, width: int, indent: str = "") -> list[str]:
    """`text` whole over lines of at most `width` columns (the later ones after `indent`): at
    spaces where it can, inside a word (a path, an id) where it must."""
    lines = textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False)
    return [line.rstrip() for line in lines] or [""]


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _index_rows(snap: StatsSnapshot) -> list[tuple[str, Any]]:
    """The namespaces' indexes in shared memory, then each tenant's against its limit
    (tenants.max_index_memory): what engines that come and go would otherwise leave."""
    mem = snap.index_memory
    rows: list[tuple[str, Any]] = [
        ("indexes", f"{format_size(mem.bytes)} in {len(snap.namespaces)} namespaces "
                    f"({mem.namespaces_forgotten_total} empty ones forgotten)")]
    for name, t in sorted(mem.tenants.items())[:32]:
        limit = format_size(t.limit_bytes) if t.limit_bytes else "no limit"
        refused = f", {t.refused_total} refused" if t.refused_total else ""
        rows.append((name, f"{format_size(t.bytes)} of {limit}{refused}"))
    return rows


def _retention_rows(snap: StatsSnapshot) -> list[tuple[str, Any]]:
    """Agent sessions' hints (docs/agents.md): taken and refused, then per tenant its retained
    blocks against its quota and what its hints did."""
    r = snap.retention
    rows: list[tuple[str, Any]] = [("hints_total", f"{r.hints_total} ({r.hints_refused_total} "
                                                   "refused as malformed)")]
    for name, t in sorted(r.tenants.items())[:32]:
        rows.append((name, f"{t.retained_blocks} blocks retained, "
                           f"{format_size(t.retained_bytes)} of {format_size(t.quota_bytes)}, "
                           f"{t.sessions} session(s); {t.cut_blocks_total} cut by the quota, "
                           f"{t.expired_blocks_total} expired, {t.released_blocks_total} "
                           f"released, {t.gave_way_blocks_total} gave way; "
                           f"{t.prewarmed_blocks_total} prewarmed, {t.prewarm_hits_total} "
                           "of them loaded"))
    return rows


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


def _tier_rows(t: TierStats) -> list[tuple[str, Any]]:
    """A tier below the pool at a glance: health, room, traffic, trouble."""
    health = f"{t.health}: {t.reason}" if t.reason else t.health
    return [
        ("health", health),
        ("directory", f"{t.directory} ({'direct' if t.direct_io else 'buffered'} I/O)")
        if t.name != "cluster" else ("master", t.directory),
        ("used", f"{format_size(t.used_bytes)} of {format_size(t.capacity_bytes)} "
                 f"({t.blocks} blocks)") if t.name != "cluster"
        else ("known", f"{t.blocks} blocks, {format_size(t.used_bytes)}, in the store (this "
                       f"node's and the ones found), named up to "
                       f"{format_size(t.capacity_bytes)}"),
        ("demoted", f"{t.demotions_total} blocks, {format_size(t.demoted_bytes_total)} in "
                    f"{t.write_seconds_total:.2f}s ({t.demotions_refused_total} refused"
                    + (f", {t.store_full_total} refused by a full store" if t.store_full_total
                       else "") + ")"),
        ("promoted", f"{t.promotions_total} blocks, {format_size(t.promoted_bytes_total)} in "
                     f"{t.read_seconds_total:.2f}s ({t.misses_total} misses)"),
        ("promoting", f"{t.promotions_open} open, {t.promotions_refused_total} refused (no "
                      f"pool slot yet), {t.promotions_late_total} given up (too slow)"),
        ("held_below", f"{t.below_keys} keys named to engines"),
        *([("found", f"{t.found_total} of {t.finds_total} keys asked about, in "
                     f"{t.find_calls_total} calls")] if t.name == "cluster" else []),
        ("evictions_total", t.evictions_total),
        ("trouble", f"{t.corrupt_total} corrupt blocks dropped, {t.failures_total} I/O errors"),
        ("queue_depth", t.queue_depth),
    ]


def _connection_rows(c: ConnectionStats) -> list[tuple[str, Any]]:
    """The sockets at a glance: gRPC connections now, and those turned away or closed."""
    return [
        ("open", f"{c.open} to the gRPC socket"),
        ("refused_total", f"{c.refused_total} (a uid at server.max_connections_per_uid)"),
        ("closed", f"{c.idle_closed_total} idle, {c.shed_total} shed at the descriptor limit"),
        ("attach_refused_total", c.attach_refused_total),
    ]


def _restart_rows(r: RestartStats) -> list[tuple[str, Any]]:
    """The warm restart at a glance: off, or what this daemon adopted and when."""
    if not r.enabled:
        return [("warm", "off (restart.warm: the cache is lost when the daemon restarts)")]
    rows: list[tuple[str, Any]] = [("warm", f"on, in {r.directory}")]
    if r.adopted:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.adopted_at))
        rows.append(("adopted", f"{r.blocks_adopted} blocks in {r.namespaces_adopted} "
                                f"namespaces at {when} ({r.adopt_seconds:.3f}s)"))
        dropped = sum(r.blocks_dropped.values())
        rows.append(("dropped", f"{dropped} blocks" + (" (" + ", ".join(
            f"{n} {why}" for why, n in sorted(r.blocks_dropped.items())) + ")"
            if dropped else "")))
        if r.held_sessions:
            rows.append(("held", f"{r.held_sessions} engines of the previous daemon, "
                                 f"{r.held_extents} free extents"))
    else:
        rows.append(("adopted", "nothing" + (f": started cold, {r.cold_reason}"
                                             if r.cold_reason else " (a first start)")))
    return rows


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
        ("retained (agent hints)", blocks.retained),
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
        ("blocks_restored_total", totals.blocks_restored_total),
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
        ("index loops", _loops(channels.native, channels.native_forced)),
    ])
    lines += [""] + _rows("connections", _connection_rows(snap.connections))
    lines += [""] + _rows("restart", _restart_rows(snap.restart))
    for tier in snap.tiers:
        lines += [""] + _rows(f"tier {tier.name}", _tier_rows(tier))
    if snap.tenants:
        lines += [""] + _rows("tenants", [
            (name, f"{format_size(t.used_bytes)} of "
                   + (format_size(t.quota_bytes) if t.quota_bytes else "the pool (no quota)"))
            for name, t in sorted(snap.tenants.items())[:32]])
    lines += [""] + _rows("index memory", _index_rows(snap))
    lines += [""] + _rows("retention", _retention_rows(snap))
    lines += ["", f"# namespaces ({len(snap.namespaces)})"]
    for ns in snap.namespaces:
        # The full id first: `kvd reset --namespace ID` takes it.
        b = ns.blocks
        lines += _wrap(f"{ns.id}  {ns.model}", WIDTH, "    ")
        lines += _wrap(
            f"    tenant {ns.tenant}, slot {format_size(ns.slot_bytes)}, "
            f"ready {b.ready}, pinned {b.pinned}, storing {b.storing}, hits "
            f"{_pct(ns.hits_total, ns.lookups_total)}, epoch {ns.epoch}", WIDTH, "    ")
        if ns.events_dropped_total:
            lines.append(f"    events_dropped_total {ns.events_dropped_total} (nobody takes "
                         "its events in time)")
        holder = ns.reclaim_holder
        if holder.session_id:
            lines += _wrap(_holder_line(holder.session_id, holder.pid, holder.live,
                                        holder.held_seconds, holder.slots_waiting),
                           WIDTH, "        ")
    lines += ["", "# rpc"]
    if snap.rpc:
        lines.append(f"{'method':<22}{'calls':>12}{'errors':>12}")
        for method, c in sorted(snap.rpc.items()):
            if len(method) > 21:           # whole, on a line of its own
                lines += _wrap(method, WIDTH)
                method = ""
            lines.append(f"{method:<22}{c.calls_total:>12}{c.errors_total:>12}")
    return "\n".join(lines)


def _loops(native: bool, forced: bool) -> str:
    """How the shared index's loops run, and why not compiled (the fix differs)."""
    if native:
        return "compiled"
    if forced:
        return "pure Python, forced by KVD_NATIVE=0 in the daemon's environment (slower)"
    return ("pure Python: kvd_proto._native was not built (no C compiler or Python headers "
            "at install; slower)")


def _holder_line(session_id: str, pid: int, live: bool, seconds: float, slots: int) -> str:
    """Who holds back the reuse of a namespace's freed slots (its id and pid first: the line
    `kvd sessions` cuts still names it)."""
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

