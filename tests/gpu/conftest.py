"""Fixtures for the GPU tests: the multi-process tests' real `kvd serve`."""

from tests.multiproc.conftest import start_daemon, workdir  # noqa: F401
