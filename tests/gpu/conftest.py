"""Fixtures for the GPU tests: the multi-process tests' real `kvd serve`."""

from tests.support.fixtures import start_daemon, workdir  # noqa: F401
