"""The CLI renders the daemon's answers without loading the daemon: `kvd --help`, `kvd stats`
and the other client commands import neither the core, the manager nor numpy."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("numpy", "kvd_server.core.core", "kvd_server.manager", "kvd_server.server", "grpc")


def test_the_cli_imports_no_daemon_internals_and_no_numpy():
    code = ("import sys, kvd_server.cli.main, kvd_server.ops.stats; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True).stdout.strip()
    assert loaded == "", f"importing the CLI loaded {loaded}"
