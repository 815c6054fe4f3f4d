"""Fixtures for the vLLM conformance tests: a real `kvd serve` and CPU engines on it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    import vllm  # noqa: F401
except Exception as exc:  # pragma: no cover - only without the vllm test environment
    pytest.skip(f"vLLM is not importable ({exc}); run `make vllm-env`",
                allow_module_level=True)

from tests.multiproc.conftest import Daemon, spawn_daemon  # noqa: E402

from .harness import Engine  # noqa: E402


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvd-v-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_daemon(workdir: Path) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def start(*args: str, **kwargs: Any) -> Daemon:
        daemon = spawn_daemon(workdir, *args, **kwargs)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.close()


@pytest.fixture
def daemon(start_daemon: Callable[..., Daemon]) -> Daemon:
    return start_daemon("--pool-size", "64MiB", "--extent-size", "4MiB")


@pytest.fixture
def engines(daemon: Daemon) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(**kwargs: Any) -> Engine:
        engine = Engine(daemon.socket, **kwargs)
        assert engine.manager.client.wait_available(10), "engine could not reach kvd"
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()
