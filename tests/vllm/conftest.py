"""Fixtures for the vLLM conformance tests: a real `kvd serve` and CPU engines on it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    import vllm  # noqa: F401
except Exception as exc:  # noqa: BLE001 - only without the vllm test environment
    pytest.skip(f"vLLM is not importable ({exc}); run `make vllm-env`",
                allow_module_level=True)

# The daemon fixtures are the multi-process tests' own: a real `kvd serve` (64 MiB pool).
from tests.support.daemon import Daemon
from tests.support.fixtures import daemon, master, start_daemon, workdir  # noqa: F401

from .harness import Engine


@pytest.fixture
def engines(daemon: Daemon) -> Iterator[Callable[..., Engine]]:  # noqa: F811
    made: list[Engine] = []

    def make(**kwargs: Any) -> Engine:
        engine = Engine(daemon.socket, **kwargs)
        assert engine.manager.client.wait_available(10), "engine could not reach kvd"
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()
