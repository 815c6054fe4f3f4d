"""Results from the tier's I/O threads, handed to the daemon's event loop in batches.

Each `call_soon_threadsafe` wakes the loop through its self-pipe (a system call, and the GIL
passed back and forth); at disk speeds that is tens of thousands of wake-ups a second. An
inbox wakes the loop once for whatever arrived until the loop gets to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class LoopInbox(Generic[T]):
    """Items put from any thread; `handle(items)` runs on the loop, one call per wake-up."""

    def __init__(self, loop: asyncio.AbstractEventLoop, handle: Callable[[list[T]], None]
                 ) -> None:
        self._loop = loop
        self._handle = handle
        self._lock = threading.Lock()
        self._items: list[T] = []

    def put(self, item: T) -> None:
        with self._lock:
            self._items.append(item)
            if len(self._items) > 1:
                return                       # a wake-up is on its way already
        with contextlib.suppress(RuntimeError):   # a closed loop: the daemon is stopping
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        if items:
            self._handle(items)
