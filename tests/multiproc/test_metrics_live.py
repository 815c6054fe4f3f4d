"""A live daemon's /metrics: promtool accepts it, and the values move with real traffic."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.support.engine import Engine, keys_for
from tests.support.metrics import free_port, scrape, value

pytestmark = pytest.mark.multiproc


def test_live_metrics_move_with_traffic_and_pass_promtool(start_daemon):
    port = free_port()
    # 1 MiB pool of 64 KiB blocks in one 1 MiB extent: 16 slots, so evictions happen.
    daemon = start_daemon("--pool-size", "1MiB", "--extent-size", "1MiB",
                          "--metrics-port", str(port))
    before = scrape(port)
    engine = Engine(daemon.socket)
    try:
        ns = engine.reg.namespace_id
        keys = keys_for("m", 24)
        engine.store(keys[:16])
        engine.load(keys[:4])
        engine.lookup(keys[16:20])
        engine.store(keys[16:20])      # pool full: evicts 4 ready blocks
        text = scrape(port)
    finally:
        engine.close()
    label = f'{{namespace="{ns}"'
    assert value(text, f'kvd_stores_total{label},outcome="completed"}}') == 20
    assert value(text, f"kvd_evictions_total{label}}}") == 4
    assert value(text, f"kvd_misses_total{label}}}") == 4
    assert value(text, 'kvd_blocks{state="ready"}') == 16
    assert value(text, "kvd_pool_used_bytes") == 1 << 20
    assert value(before, "kvd_pool_used_bytes") == 0
    assert value(text, 'kvd_tenant_used_bytes{tenant="default"}') == 1 << 20
    # 20 stores and 4 loads completed, of 64 KiB blocks, counted by the daemon itself.
    assert value(text, "kvd_stored_bytes_total") == 20 * (64 << 10)
    assert value(text, "kvd_loaded_bytes_total") == 4 * (64 << 10)
    assert value(text, 'kvd_tenant_quota_bytes{tenant="default"}') == 0
    assert 'kvd_rpc_duration_seconds_count{method="PrepareStore"}' in text
    # Dashboards name a namespace's lines by joining on its info series.
    assert value(text, f'kvd_namespace_info{{model="test-model",namespace="{ns}",'
                       'tenant="default"}') == 1
    # What an operator of a memory daemon looks for first, from the daemon's own process.
    assert value(text, "process_resident_memory_bytes") > 1 << 20
    assert value(text, "process_open_fds") > 0
    assert "python_gc_collections_total{" in text and "python_info{" in text
    assert "_created" not in text
    assert daemon.log().count(f"127.0.0.1:{port}/metrics") == 1
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian: prometheus); CI installs it")
    proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
