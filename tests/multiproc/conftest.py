"""The multi-process tests' fixtures: a real `kvd serve` on a temporary socket and engine
sessions on it. They live in tests/support/fixtures.py (the harness other directories share);
importing them here is what makes pytest find them in this directory."""

from tests.support.fixtures import daemon, engines, master, start_daemon, workdir  # noqa: F401
