"""A namespace's stored / removed events, in order, for the engines' KV-event consumers.

Bounded (MAX_PENDING_EVENTS: the oldest is dropped and counted when nobody takes them), and
taken in answers of a bounded size. A `metadata_only` removal (a failed store) is sent only
for keys that are still absent when it is taken: a retry may own the key again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .types import OffloadEvent

MAX_PENDING_EVENTS = 100_000


def event_bytes(event: OffloadEvent) -> int:
    """About what an event costs on the wire (keys with their framing, plus the flags)."""
    return sum(len(k) + 3 for k in event.keys) + 8


class EventQueue:
    def __init__(self) -> None:
        self._events: deque[OffloadEvent] = deque()
        self.dropped_total = 0

    def __len__(self) -> int:
        return len(self._events)

    def emit(self, event: OffloadEvent) -> None:
        events = self._events
        if len(events) >= MAX_PENDING_EVENTS:
            events.popleft()
            self.dropped_total += 1
        events.append(event)

    def take(self, absent: Callable[[bytes], bool], max_events: int | None = None,
             max_bytes: int | None = None) -> tuple[list[OffloadEvent], bool]:
        """Events in order, at most `max_events` and about `max_bytes` of keys (always at
        least one event); `more` says whether any are left. `absent(key)`: whether no block
        of `key` is resident now (for metadata-only removals)."""
        events = self._events
        if not events:
            return [], False
        out: list[OffloadEvent] = []
        limit = len(events) if max_events is None else max_events
        budget = max_bytes
        while events and len(out) < limit:
            event = events[0]
            if event.metadata_only:
                # A retry may already own the key again: then the clean-up is moot.
                keys = tuple(k for k in event.keys if absent(k))
                if not keys:
                    events.popleft()
                    continue
                event = OffloadEvent(keys, removed=True, metadata_only=True)
            if budget is not None:
                cost = event_bytes(event)
                if out and cost > budget:
                    break
                budget -= cost
            events.popleft()
            out.append(event)
        return out, bool(events)
