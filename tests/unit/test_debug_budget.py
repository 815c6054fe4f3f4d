"""DEBUG lines are rate-bounded (kvd_server.ops.logs.DebugBudget): a burst passes, then about
DEBUG_RATE a second; the first line after a gap says how many were dropped; INFO and above
always pass."""

from __future__ import annotations

import io
import logging

from kvd_server.ops import logs


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _logger(budget: logs.DebugBudget) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.addFilter(budget)
    log = logging.getLogger("kvd_server.test_debug_budget")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.DEBUG)
    return log, stream


def test_a_burst_passes_then_the_rate_and_the_drop_is_counted():
    clock = Clock()
    log, stream = _logger(logs.DebugBudget(rate=10, burst=20, clock=clock))
    for i in range(100):
        log.debug("line %d", i)
    log.info("an info line always passes")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 21 and lines[-1] == "INFO an info line always passes"
    clock.now = 1.0                                  # ten more lines' worth
    for i in range(100, 200):
        log.debug("line %d", i)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 31
    assert lines[21] == ("DEBUG line 100 (80 debug lines dropped before this one: more than "
                         "10 a second)")
    assert lines[22] == "DEBUG line 101"


def test_configure_installs_the_budget():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in logs.KVD_LOGGERS}
    try:
        logs.configure("debug", "text", io.StringIO())
        (handler,) = root.handlers
        assert any(isinstance(f, logs.DebugBudget) for f in handler.filters)
    finally:
        root.handlers[:], root.level = saved
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
