"""A namespace's stored / removed events, in order, for the engines' KV-event consumers.

Bounded in count (MAX_PENDING_EVENTS) and in the memory they hold (MAX_PENDING_EVENT_BYTES):
nobody may take them at all (no engine enables KV events), so past either bound the oldest are
dropped and counted. Taken in answers of a bounded size. A `metadata_only` removal (a failed store) is sent only
for keys that are still absent when it is taken: a retry may own the key again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .types import OffloadEvent

MAX_PENDING_EVENTS = 100_000
# Per namespace. A consumer that takes every step (vLLM's KV-event publisher) needs about one
# step's events: a few thousand keys, under 2 MiB. Bounded by count alone, 100,000 events of
# 4096 128-byte keys could hold ~55 GiB (measured: +15 MiB/s while nobody took them).
MAX_PENDING_EVENT_BYTES = 16 << 20
KEY_MEMORY = 41         # per key beyond its bytes: the bytes object (33) and its tuple slot (8)
EVENT_MEMORY = 128      # per event: the event, its keys' tuple, its place in the queue


def event_memory(event: OffloadEvent) -> int:
    """About what a waiting event holds of the daemon's memory (the unit of the bound)."""
    keys = event.keys
    return EVENT_MEMORY + KEY_MEMORY * len(keys) + sum(map(len, keys))


def event_bytes(event: OffloadEvent) -> int:
    """About what an event costs on the wire (keys with their framing, plus the flags)."""
    return sum(len(k) + 3 for k in event.keys) + 8


class EventQueue:
    """A namespace's events; not `enabled` (the namespace's engines take none), it keeps
    none and answers none."""

    def __init__(self, max_bytes: int = MAX_PENDING_EVENT_BYTES,
                 max_events: int = MAX_PENDING_EVENTS, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._events: deque[OffloadEvent] = deque()
        self._costs: deque[int] = deque()       # event_memory of each, in the same order
        self.bytes = 0                          # their sum
        self.max_bytes = max_bytes
        self.max_events = max_events
        # Events dropped unseen (one cut to its newest keys counts as one).
        self.dropped_total = 0

    def __len__(self) -> int:
        return len(self._events)

    def emit(self, event: OffloadEvent) -> None:
        if not self.enabled:
            return
        cost = event_memory(event)
        if cost > self.max_bytes:
            # One event over the whole bound (a reset's removal of every block): keep its
            # newest keys, as the queue keeps its newest events.
            event, cost = self._newest_part(event)
            self.dropped_total += 1
        events, costs = self._events, self._costs
        while events and (len(events) >= self.max_events
                          or self.bytes + cost > self.max_bytes):
            events.popleft()
            self.bytes -= costs.popleft()
            self.dropped_total += 1
        events.append(event)
        costs.append(cost)
        self.bytes += cost

    def _newest_part(self, event: OffloadEvent) -> tuple[OffloadEvent, int]:
        keys = event.keys
        room = self.max_bytes - EVENT_MEMORY
        n = 0
        for key in reversed(keys):
            room -= KEY_MEMORY + len(key)
            if room < 0 and n:
                break
            n += 1
        part = OffloadEvent(keys[len(keys) - n:], event.removed, event.metadata_only)
        return part, event_memory(part)

    def _pop(self) -> None:
        self._events.popleft()
        self.bytes -= self._costs.popleft()

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
                    self._pop()
                    continue
                event = OffloadEvent(keys, removed=True, metadata_only=True)
            if budget is not None:
                cost = event_bytes(event)
                if out and cost > budget:
                    break
                budget -= cost
            self._pop()
            out.append(event)
        return out, bool(events)
