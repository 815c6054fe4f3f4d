"""The daemon's logging: readable text lines or one JSON object per line, on stderr.

`server.log_level` applies to kvd's own loggers only. Other libraries (gRPC's Python layer,
asyncio, the metrics HTTP server) log warnings and errors, so `--log-level debug` shows why kvd
did something, not the event loop's selector or gRPC's channel internals. (gRPC's C core does not
log through Python at all; its own switches are the GRPC_VERBOSITY and GRPC_TRACE variables.)
At debug, kvd adds each attach (peer, role, what was handed over), each channel closed, and a
line every 10 s about what changed (sessions, namespaces created or forgotten with their
layouts, slots held granted, channel records by kind); never a line per key or per step, and
DEBUG lines are rate-bounded (DebugBudget).
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

KVD_LOGGERS = ("kvd_server", "kvd_proto", "kvd_client")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
OTHERS_LEVEL = logging.WARNING
DEBUG_RATE = 50.0       # DEBUG lines a second on average, past a burst of DEBUG_BURST
DEBUG_BURST = 200


class DebugBudget(logging.Filter):
    """Bounds DEBUG lines (a token bucket): at `--log-level debug` a busy daemon (an attach
    flood, thousands of sessions) must not spend the engines' time writing its log. The first
    line let through after a gap says how many were dropped. Other levels always pass."""

    def __init__(self, rate: float = DEBUG_RATE, burst: int = DEBUG_BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)
        self.stamp = clock()
        self.dropped = 0
        self._lock = threading.Lock()      # the pre-fault and metrics threads log too

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG:
            return True
        with self._lock:
            now = self.clock()
            self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens < 1.0:
                self.dropped += 1
                return False
            self.tokens -= 1.0
            dropped, self.dropped = self.dropped, 0
        if dropped:
            record.msg = (f"{record.getMessage()} ({dropped} debug lines dropped before this "
                          f"one: more than {self.rate:g} a second)")
            record.args = None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, for log pipelines: `time` (UTC, ISO 8601 with
    milliseconds), `level`, `logger`, `message`, and `exception` (the traceback text) when the
    record carries one."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        doc = {
            "time": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exception"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, ensure_ascii=False)


def configure(level: str, fmt: str, stream: TextIO | None = None) -> None:
    """Send every record to `stream` (stderr) in `fmt` ("text" or "json"); kvd's loggers at
    `level`, everyone else's at WARNING (or `level`, if that is higher)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(DebugBudget())
    numeric = logging.getLevelName(level.upper())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(numeric, OTHERS_LEVEL))
    for name in KVD_LOGGERS:
        logging.getLogger(name).setLevel(numeric)
