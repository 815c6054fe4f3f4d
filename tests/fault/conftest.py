"""Fault tests reuse the multi-process tests' daemon fixtures (a real `kvd serve`)."""

from tests.multiproc.conftest import daemon, start_daemon, workdir  # noqa: F401
