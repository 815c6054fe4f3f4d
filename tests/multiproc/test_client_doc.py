"""docs/client.md's examples leave `kvd stats` showing their copies (issue 22, item 8).

The daemon never sees a copy, so the transfer rows of `kvd stats` count only what clients
report; an example that reports nothing teaches engines to leave them at 0B while blocks are
stored and loaded. Run against a real daemon, the page's examples must report exactly the bytes
the daemon counted as completed.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvd_server.units import format_size
from tests.support.daemon import PY, ROOT, clean_env, spawn_daemon
from tests.support.doc_examples import RUN_TIMEOUT, RUNNER, examples

pytestmark = pytest.mark.multiproc
PAGE = ROOT / "docs" / "client.md"


def run_page(page: Path, workdir: Path) -> tuple[dict[str, Any], str]:
    """Run `page`'s Python examples as test_docs_examples does (one interpreter, a daemon on
    the default socket); the daemon's stats afterwards, as JSON and as `kvd stats` prints them."""
    runtime = workdir / "run"
    env = clean_env(XDG_RUNTIME_DIR=str(runtime))
    daemon = spawn_daemon(workdir, "--pool-size", "64MiB", env=env,
                          socket=str(runtime / "kvd" / "kvd.sock"))
    try:
        blocks = [(str(page.relative_to(ROOT)), e.line, e.code) for e in examples(page)
                  if e.lang == "python" and e.skip is None]
        assert blocks, f"{page} has no Python example"
        cwd = workdir / "cwd"
        cwd.mkdir()
        out = subprocess.run([PY, "-c", RUNNER], input=json.dumps(blocks), env=env, cwd=cwd,
                             capture_output=True, text=True, timeout=RUN_TIMEOUT)
        assert out.returncode == 0, out.stdout + out.stderr
        table = daemon.kvd("stats")
        assert table.returncode == 0, table.stderr
        return daemon.stats(), table.stdout
    finally:
        daemon.close()


def test_the_examples_report_the_bytes_they_copy(workdir: Path):
    stats, table = run_page(PAGE, workdir)
    t = stats["transfers"]
    assert stats["blocks"]["ready"] > 0 and t["completed_store_bytes_total"] > 0
    assert t["completed_load_bytes_total"] > 0, "the examples load nothing"
    # What the engine reported is what the daemon counted as completed, byte for byte.
    assert t["store_bytes_total"] == t["completed_store_bytes_total"], t
    assert t["load_bytes_total"] == t["completed_load_bytes_total"], t
    assert t["store_seconds_total"] > 0 and t["load_seconds_total"] > 0, t
    for row, total in (("stored", t["store_bytes_total"]), ("loaded", t["load_bytes_total"])):
        assert re.search(rf"^{row}\s+{re.escape(format_size(total))} in ", table, re.M), table
