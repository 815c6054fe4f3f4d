"""Prometheus exposition: names, values and promtool's own checks."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import pytest
from prometheus_client import generate_latest

from kvd_server.ops.metrics import MAX_NAMESPACE_LABELS, build_registry, start_metrics
from kvd_server.ops.stats import StatsSnapshot


def _doc(namespaces: int = 2) -> dict:
    return {
        "server": {"version": "0.1.0", "state": "serving", "policy": "lru", "uptime_seconds": 3.5},
        "pool": {"total_bytes": 1 << 30, "used_bytes": 1 << 26, "free_bytes": (1 << 30) - (1 << 26),
                 "extent_bytes": 1 << 26, "prefault_bytes_done": 1 << 30, "mlocked": False},
        "blocks": {"storing": 1, "ready": 5, "pinned": 2, "zombie": 0, "total": 8},
        "sessions": 3,
        "clients": {"active": 3, "attached_total": 7, "reaped_total": 1, "closed_total": 3},
        "namespaces": [
            {"id": f"ns{i:02d}", "model": f"org/model-{i}", "tenant": "team-a",
             "slots_capacity": 100, "lookups_total": 10, "hits_total": 6,
             "misses_total": 4, "stores_started_total": 5, "stores_completed_total": 4,
             "stores_failed_total": 1, "evictions_total": 2, "store_rejections_total": 0,
             "blocks": {"storing": 0, "ready": 4, "pinned": 1, "zombie": 0}}
            for i in range(namespaces)
        ],
        "stats": {"pins": 2, "leases": 1, "leases_expired_total": 4, "resets_total": 1,
                  "step_calls_total": 9, "step_ops_total": 20},
        "transfers": {"load_bytes_total": 1000, "load_seconds_total": 0.5,
                      "store_bytes_total": 2000, "store_seconds_total": 0.25,
                      "completed_load_bytes_total": 4096, "completed_store_bytes_total": 8192},
        "tenants": {"default": {"used_bytes": 1 << 20, "quota_bytes": 0},
                    "team-a": {"used_bytes": 0, "quota_bytes": 4 << 20}},
        "retention": {"hints_total": 5, "hints_refused_total": 1,
                      "tenants": {"team-a": {"retained_blocks": 3, "retained_bytes": 3 << 16,
                                             "quota_bytes": 2 << 20, "sessions": 1,
                                             "retained_blocks_total": 4, "cut_blocks_total": 1,
                                             "expired_blocks_total": 1,
                                             "released_blocks_total": 0,
                                             "gave_way_blocks_total": 0,
                                             "prewarmed_blocks_total": 2,
                                             "prewarm_hits_total": 2}}},
    }


def _exposition(doc: dict) -> str:
    registry, rpc = build_registry(lambda: StatsSnapshot.from_dict(doc))
    rpc.observe("Step", 0.0004)
    rpc.observe("Lookup", 0.002, "INVALID_ARGUMENT")
    rpc.observe_step(3, 70)
    rpc.observe_transfer([2_000_000], [30_000_000, 500])
    return generate_latest(registry).decode()


def test_values_follow_the_stats_document():
    text = _exposition(_doc())
    assert "kvd_pool_total_bytes 1.073741824e+09" in text
    assert 'kvd_blocks{state="ready"} 5.0' in text
    assert "kvd_sessions 3.0" in text
    assert 'kvd_hits_total{namespace="ns01"} 6.0' in text
    assert 'kvd_stores_total{namespace="ns00",outcome="failed"} 1.0' in text
    assert 'kvd_state{state="serving"} 1.0' in text
    assert 'kvd_rpc_errors_total{code="INVALID_ARGUMENT",method="Lookup"} 1.0' in text
    assert 'kvd_transfer_size_bytes_count{transfer_type="GPU_to_CPU"} 2.0' in text
    assert "kvd_transfer_load_bytes_total 1000.0" in text


def test_connection_counts_follow_the_stats_document():
    doc = _doc()
    doc["connections"] = {"open": 3, "refused_total": 2, "idle_closed_total": 5,
                          "shed_total": 1, "attach_refused_total": 4}
    text = _exposition(doc)
    assert "kvd_connections 3.0" in text
    assert "kvd_connections_refused_total 2.0" in text
    assert "kvd_connections_idle_closed_total 5.0" in text
    assert "kvd_connections_shed_total 1.0" in text
    assert "kvd_attach_refused_total 4.0" in text


def test_namespace_labels_are_bounded():
    text = _exposition(_doc(namespaces=MAX_NAMESPACE_LABELS + 5))
    assert 'kvd_hits_total{namespace="other"} 30.0' in text
    labels = {line.split('namespace="')[1].split('"')[0]
              for line in text.splitlines() if line.startswith("kvd_hits_total{")}
    assert len(labels) == MAX_NAMESPACE_LABELS + 1


def test_namespace_info_names_each_namespace_within_the_bound():
    text = _exposition(_doc(namespaces=MAX_NAMESPACE_LABELS + 5))
    assert 'kvd_namespace_info{model="org/model-1",namespace="ns01",tenant="team-a"} 1.0' in text
    assert 'kvd_namespace_info{model="other",namespace="other",tenant="other"} 1.0' in text
    assert text.count("\nkvd_namespace_info{") == MAX_NAMESPACE_LABELS + 1


def test_standard_process_and_python_series_and_no_created_samples():
    text = _exposition(_doc())
    for name in ("process_resident_memory_bytes", "process_open_fds", "process_max_fds",
                 "process_cpu_seconds_total", "process_start_time_seconds",
                 'python_info{implementation="CPython"', "python_gc_collections_total"):
        assert f"\n{name}" in text, name
    assert "_created" not in text


def test_broken_snapshot_reports_down():
    def boom() -> StatsSnapshot:
        raise RuntimeError("x")

    registry, _ = build_registry(boom)
    assert "kvd_up 0.0" in generate_latest(registry).decode()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian: prometheus)")
def test_promtool_check_metrics():
    proc = subprocess.run(["promtool", "check", "metrics"], input=_exposition(_doc()),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_http_endpoint():
    registry, _ = build_registry(lambda: StatsSnapshot.from_dict(_doc()))
    server = start_metrics(registry, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
            body = resp.read().decode()
        assert "kvd_pool_free_bytes" in body
    finally:
        server.close()


def _dashboard_exprs() -> list[str]:
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvd-dashboard.json"
    dash = json.loads(path.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian: prometheus)")
def test_grafana_dashboard_expressions_are_valid_promql(tmp_path):
    import json

    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:panel_{i}", "expr": expr.replace("$instance", ".*")}
        for i, expr in enumerate(_dashboard_exprs())]}]}
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))      # JSON is YAML
    proc = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_grafana_dashboard_uses_exposed_metrics():
    import re

    exprs = _dashboard_exprs()
    assert exprs
    exposed = {line.split("{")[0].split(" ")[0]
               for line in _exposition(_doc()).splitlines() if line and not line.startswith("#")}
    used = {m for e in exprs for m in re.findall(r"\b(kvd_[a-z_]+)", e)}
    missing = used - exposed
    assert not missing, f"dashboard references metrics the daemon does not expose: {missing}"


def test_every_manager_counter_reaches_the_namespace_rows():
    """A counter the manager keeps and the stats never show costs the hot path for nobody."""
    import dataclasses

    from kvd_server.manager import ManagerCounters
    from kvd_server.ops.snapshot import MANAGER_COUNTERS

    assert set(MANAGER_COUNTERS) == {f.name for f in dataclasses.fields(ManagerCounters)}


def test_retention_series_follow_the_stats_document():
    text = _exposition(_doc())
    for line in ('kvd_retention_hints_total 5.0', 'kvd_retention_hints_refused_total 1.0',
                 'kvd_retention_blocks{tenant="team-a"} 3.0',
                 'kvd_retention_quota_bytes{tenant="team-a"} 2.097152e+06',
                 'kvd_retention_cut_blocks_total{tenant="team-a"} 1.0',
                 'kvd_retention_prewarm_hits_total{tenant="team-a"} 2.0'):
        assert line in text, line
