"""Fault tests reuse the multi-process tests' daemon fixtures (a real `kvd serve`), and print
what they measured at the end of the run (tests/support/summary.py)."""

from __future__ import annotations

from typing import Any

from tests.support import summary
from tests.support.fixtures import daemon, start_daemon, workdir  # noqa: F401


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if summary.COUNTS:
        failed = len(terminalreporter.stats.get("failed", []))
        terminalreporter.write_line(summary.render(failed))
