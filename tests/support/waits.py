"""Bounded waits: a test waits on the condition it then relies on, never a fixed sleep, so
it is as fast as the daemon allows and fails with what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.05, detail: Callable[[], Any] | None = None) -> Any:
    """Poll `predicate` until truthy (its value); fail the test naming `what` (and `detail()`,
    what was seen last) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            seen = f": {detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{seen}")
        time.sleep(interval)
