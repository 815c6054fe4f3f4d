"""docs/operations.md's metrics table and the daemon's /metrics agree, both ways.

Every metric family the daemon exports (kvd_server/ops/metrics.py, with every section of the
stats document filled: namespaces, tenants, both tiers, warm restart) is named in the table,
and every `kvd_*` series name the README and docs/ give is one the daemon exports (the docs
once said `kvd_tier_health` for `kvd_tier_up`, and left out every `kvd_restart_*` family).
"""

from __future__ import annotations

import pathlib
import re

from kvd_server.ops.metrics import build_registry
from kvd_server.ops.stats import StatsSnapshot

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
# `kvd_*` words in the docs that are not metrics: the packages, the wheel's file name.
PACKAGES = {"kvd_server", "kvd_client", "kvd_proto", "kvd_pb2", "kvd_pb2_grpc", "kvd_offload"}
SUFFIXES = ("_bucket", "_count", "_sum")      # a histogram's series


def _full_snapshot() -> StatsSnapshot:
    """A stats document with every section that adds families to /metrics."""
    tier = {"health": "degraded", "reason": "why", "capacity_bytes": 1 << 30,
            "used_bytes": 1 << 20, "blocks": 16}
    return StatsSnapshot.from_dict({
        "server": {"version": "0.1.0", "state": "serving", "policy": "lru"},
        "namespaces": [{"id": "ns00", "model": "m", "tenant": "t", "lookups_total": 1,
                        "blocks": {"ready": 1}, "reclaim_holder": {"session_id": "s"}}],
        "tenants": {"t": {"used_bytes": 1, "quota_bytes": 2}},
        "channels": {"open": 1, "records_total": {"store": 1}},
        "restart": {"enabled": True, "adopted": True, "blocks_adopted": 3,
                    "blocks_dropped": {"being stored": 1}, "held_sessions": 1},
        "tiers": [{"name": "disk", **tier}, {"name": "cluster", **tier}],
        "rpc": {"Stats": {"calls_total": 1, "errors_total": 0}},
    })


def _exported() -> set[str]:
    """The names of the kvd_* families as Prometheus shows them (counters with `_total`,
    info families with `_info`)."""
    registry, _ = build_registry(_full_snapshot)
    names = set()
    for family in registry.collect():
        if not family.name.startswith("kvd_"):
            continue
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        names.add(family.name + suffix)
    return names


def _table_names() -> set[str]:
    """The names in the first column of operations.md's metrics table."""
    lines = OPERATIONS.read_text().splitlines()
    start = lines.index("| metric | type | labels | meaning |")
    names: set[str] = set()
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        names |= set(re.findall(r"`(kvd_[a-z0-9_]+)`", line.split("|")[1]))
    return names


def _client_config_keys() -> set[str]:
    """vLLM's kv_connector_extra_config keys kvd_client reads (`kvd_socket`, ...): named in
    the docs, not metrics."""
    keys: set[str] = set()
    for path in (ROOT / "kvd_client").rglob("*.py"):
        keys |= set(re.findall(r"[\"'](kvd_[a-z0-9_]+)[\"']", path.read_text()))
    return keys


def test_every_exported_family_is_in_the_operations_table():
    exported, table = _exported(), _table_names()
    assert {"kvd_tier_up", "kvd_restart_blocks_dropped_total"} <= exported  # the test sees them
    missing = sorted(exported - table)
    assert not missing, f"exported but not in docs/operations.md's metrics table: {missing}"


def test_every_kvd_name_the_docs_give_is_exported():
    exported = _exported()
    not_metrics = PACKAGES | _client_config_keys()
    wrong = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in re.finditer(r"\bkvd_[a-z0-9_]+(\*)?", line):
                name, family = match.group(0).rstrip("*"), match.group(1) is not None
                if name in not_metrics:
                    continue
                if family:       # `kvd_tier_*`: some exported family starts so
                    ok = any(e.startswith(name) for e in exported)
                else:
                    ok = name in exported or any(
                        name == e + s for e in exported for s in SUFFIXES)
                if not ok:
                    wrong.append(f"{page.relative_to(ROOT)}:{number}: {match.group(0)}")
    assert not wrong, f"names the daemon does not export: {wrong}"
