"""One log line per interval for a condition a peer can repeat at will (a malformed hint sent
with every request): the first occurrence is logged at once, the rest counted and summed up in
the next line, so neither the daemon's log nor an engine's grows with what a client sends.
A leaf used by both the daemon and the client."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

DEFAULT_INTERVAL_S = 10.0


class RateLimitedLog:
    """`warning(msg, *args)` logs at most once per `interval` seconds; `total` counts every
    call (the caller's counter of the condition)."""

    def __init__(self, log: logging.Logger, interval: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.interval = interval
        self.clock = clock
        self.total = 0
        self._suppressed = 0
        self._next = 0.0

    def warning(self, msg: str, *args: object) -> None:
        self.total += 1
        now = self.clock()
        if now < self._next:
            self._suppressed += 1
            return
        self._next = now + self.interval
        if self._suppressed:
            msg += f" ({self._suppressed} more like it since the last such line)"
            self._suppressed = 0
        self.log.warning(msg, *args)
