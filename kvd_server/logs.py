"""The daemon's logging: readable text lines or one JSON object per line, on stderr.

`server.log_level` applies to kvd's own loggers only. Other libraries (gRPC's Python layer,
asyncio, the metrics HTTP server) log warnings and errors, so `--log-level debug` shows why kvd
did something, not the event loop's selector or gRPC's channel internals. (gRPC's C core does not
log through Python at all; its own switches are the GRPC_VERBOSITY and GRPC_TRACE variables.)
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import TextIO

KVD_LOGGERS = ("kvd_server", "kvd_proto", "kvd_client")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
OTHERS_LEVEL = logging.WARNING


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
    numeric = logging.getLevelName(level.upper())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(numeric, OTHERS_LEVEL))
    for name in KVD_LOGGERS:
        logging.getLogger(name).setLevel(numeric)
