"""A real daemon's log: JSON lines for pipelines, and `--log-level debug` showing kvd's own
reasons without asyncio's or gRPC's internals."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.daemon import Daemon
from tests.support.engine import Engine

pytestmark = pytest.mark.multiproc


def test_json_log_lines_with_utc_times_and_kvds_debug_only(start_daemon):
    daemon: Daemon = start_daemon("--pool-size", "8MiB", "--extent-size", "4MiB",
                                  "--log-format", "json", "--log-level", "debug")
    Engine(daemon.socket).close()                    # an attach logs a kvd debug line
    assert daemon.terminate() == 0
    records = [json.loads(line) for line in daemon.log().splitlines()]  # every line is JSON
    assert records
    for record in records:
        assert set(record) >= {"time", "level", "logger", "message"}, record
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["time"]), record
        assert record["logger"].startswith("kvd_") or record["level"] in ("WARNING", "ERROR",
                                                                          "CRITICAL"), record
    messages = [r["message"] for r in records]
    assert any(r["level"] == "DEBUG" and r["logger"] == "kvd_server.attach.roles" for r in records)
    assert any(m.startswith("serving on ") for m in messages)
    assert messages[-1] == "kvd stopped"
    # gRPC's Python layer logs ~30 debug lines of its own ("Loaded running loop", ...).
    assert not any(r["logger"].startswith("grpc") for r in records)


def test_text_is_the_default(daemon: Daemon):
    first = daemon.log().splitlines()[0]
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO kvd_server\.server: kvd ", first)
