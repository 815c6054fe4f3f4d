"""The daemon's log lines: JSON for pipelines, and debug for kvd's own loggers only."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest

from kvd_server.ops import logs


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in logs.KVD_LOGGERS}
    yield
    root.handlers[:], root.level = saved
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def _lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_json_lines_carry_utc_time_level_logger_message_and_exception(restore_logging):
    stream = io.StringIO()
    logs.configure("info", "json", stream)
    log = logging.getLogger("kvd_server.server")
    log.info("serving on %s", "/run/kvd/kvd.sock")
    try:
        raise RuntimeError("pool gone")
    except RuntimeError:
        log.exception("sweep failed")
    first, second = (json.loads(line) for line in _lines(stream))
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])
    assert first == {"time": first["time"], "level": "INFO", "logger": "kvd_server.server",
                     "message": "serving on /run/kvd/kvd.sock"}
    assert second["level"] == "ERROR" and second["message"] == "sweep failed"
    assert "Traceback" in second["exception"] and "RuntimeError: pool gone" in second["exception"]


def test_debug_shows_kvds_lines_not_other_libraries(restore_logging):
    stream = io.StringIO()
    logs.configure("debug", "text", stream)
    logging.getLogger("kvd_server.core.core").debug("why kvd did it")
    logging.getLogger("kvd_client.client").debug("client detail")
    logging.getLogger("asyncio").debug("Using selector: EpollSelector")
    logging.getLogger("grpc._cython.cygrpc").debug("channel internals")
    logging.getLogger("asyncio").warning("a slow callback")
    text = stream.getvalue()
    assert "why kvd did it" in text and "client detail" in text
    assert "EpollSelector" not in text and "channel internals" not in text
    assert "a slow callback" in text
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} DEBUG kvd_server.core.core: why", text)


def test_a_higher_level_quiets_everyone(restore_logging):
    stream = io.StringIO()
    logs.configure("error", "text", stream)
    logging.getLogger("kvd_server.server").warning("kvd warning")
    logging.getLogger("grpc").warning("grpc warning")
    logging.getLogger("kvd_server.server").error("kvd error")
    assert _lines(stream) and all("error" in line for line in _lines(stream))
