"""The pytest fixtures over the harness: a short temporary directory, daemons started in it
and stopped at teardown (a traceback in a daemon's log fails the test), engine sessions.
Not collected from here: each directory's conftest.py imports the ones it uses."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import EXTENT, POOL, Daemon, spawn_daemon
from tests.support.engine import Engine


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short temporary directory (Unix socket paths are limited to ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvd-t-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_daemon(workdir: Path) -> Iterator[Callable[..., Daemon]]:
    """Factory: start a daemon (kwargs as spawn_daemon); all of them stop at teardown."""
    started: list[Daemon] = []

    def start(*args: str, **kwargs: Any) -> Daemon:
        daemon = spawn_daemon(workdir, *args, **kwargs)
        started.append(daemon)
        return daemon

    try:
        yield start
    finally:
        for daemon in started:
            daemon.close()
    # A traceback in a daemon's log is a bug even when every assertion passed.
    for daemon in started:
        assert "Traceback" not in daemon.log(), daemon.log()


@pytest.fixture
def daemon(start_daemon: Callable[..., Daemon]) -> Daemon:
    """A serving daemon with a 64MiB pool, 4MiB extents and a 1s liveness timeout."""
    return start_daemon("--pool-size", POOL, "--extent-size", EXTENT)


@pytest.fixture
def engines(daemon: Daemon) -> Iterator[Callable[..., Engine]]:
    """Factory of Engine sessions on `daemon`, closed at teardown."""
    made: list[Engine] = []

    def make(**kwargs: Any) -> Engine:
        engine = Engine(daemon.socket, **kwargs)
        made.append(engine)
        return engine

    try:
        yield make
    finally:
        for engine in made:
            engine.close()


@pytest.fixture
def master(workdir: Path) -> Iterator[Any]:
    """A real `mooncake_master` on loopback for the test (SIGKILLed after it)."""
    from tests.support import mooncake

    m = mooncake.Master(workdir)
    m.start()
    try:
        yield m
    finally:
        m.stop()
