"""`kvd serve` loads only what every daemon needs before it serves: the modules that only some
configurations use (metrics, reflection, the tiers below the pool, the cluster's store) load
where they are configured, and loading the daemon starts no thread of its own (numpy's BLAS
would start one per core that spins: CPU a start on a loaded node does not have). Counts, not
timings: bench/restart.py times a warm restart from exec to SERVING."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# Module -> the configuration that needs it (none of them is on by default).
ONLY_WHEN_CONFIGURED = {
    "prometheus_client": "server.metrics_port",
    "kvd_server.ops.metrics": "server.metrics_port",
    "grpc_reflection.v1alpha.reflection": "server.reflection",
    "kvd_server.tiers.link": "tiers.disk or tiers.cluster",
    "kvd_server.tiers.demotion": "tiers.disk or tiers.cluster",
    "kvd_server.tiers.promotion": "tiers.disk or tiers.cluster",
    "kvd_server.tiers.below_table": "tiers.disk or tiers.cluster",
    "kvd_server.tiers.stack": "tiers.disk and tiers.cluster",
    "kvd_server.tiers.disk.tier": "tiers.disk",
    "kvd_server.tiers.disk.space": "tiers.disk",
    "kvd_server.tiers.disk.journal": "tiers.disk",
    "kvd_server.tiers.cluster.tier": "tiers.cluster",
    "kvd_server.tiers.cluster.store": "tiers.cluster",
    "kvd_server.tiers.cluster.store_agent": "tiers.cluster",
    "importlib.metadata": "nothing: kvd's version is read without it",
}


def _after(code: str) -> dict:
    """sys.modules and the process's threads after `code`, in a fresh interpreter."""
    probe = (f"{code}\nimport json, os, sys\n"
             "print(json.dumps({'modules': sorted(sys.modules), "
             "'threads': len(os.listdir('/proc/self/task'))}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_the_daemon_loads_no_module_that_only_some_configurations_need():
    loaded = set(_after("import kvd_server.cli.main, kvd_server.server")["modules"])
    extra = {name: why for name, why in ONLY_WHEN_CONFIGURED.items() if name in loaded}
    assert not extra, f"loaded before anything is configured: {extra}"
    # What every daemon needs is there: the check above would pass on an import that failed.
    assert {"kvd_server.server", "kvd_server.restart.warm", "grpc", "numpy"} <= loaded


def test_loading_the_daemon_as_kvd_serve_does_starts_no_thread():
    after = _after("from kvd_server.cli.main import import_daemon\nimport_daemon()")
    assert "kvd_server.server" in after["modules"]
    assert after["threads"] == 1, f"{after['threads'] - 1} thread(s) started by loading the " \
        "daemon (numpy's BLAS: OPENBLAS_NUM_THREADS)"


def test_an_installed_wheel_names_its_version_by_its_metadata_directory(tmp_path: Path):
    from kvd_proto.version import _installed_version

    (tmp_path / "kvd_offload-1.2.3.dist-info").mkdir()
    (tmp_path / "kvd_proto").mkdir()
    assert _installed_version(tmp_path) == "1.2.3"
    (tmp_path / "kvd_offload-1.2.4.dist-info").mkdir()        # two: ask importlib.metadata
    assert _installed_version(tmp_path) == ""
