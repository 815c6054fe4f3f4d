"""The namespace's stored/removed events, as the daemon answers them, until the engine takes
them; and how many the daemon dropped before anyone took them (it bounds what waits)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvd_proto import records as rec

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Event:
    """A stored (removed=False) or removed event of the namespace's blocks."""

    keys: tuple[bytes, ...]
    removed: bool
    metadata_only: bool = False


class EventInbox:
    def __init__(self) -> None:
        self._events: list[Event] = []
        self.dropped = 0                  # events the daemon dropped before this engine took

    def add(self, answer: rec.Events) -> None:
        """One EVENTS answer: its events, and the drop it reports (warned about once: it
        recurs while events are taken too rarely, a line per step would flood the log)."""
        if answer.dropped:
            if not self.dropped:
                log.warning("kvd: the daemon dropped %d KV events nobody took in time (it "
                            "bounds what waits per namespace): KV-event consumers missed some "
                            "stored/removed blocks; counted in events_dropped, not logged "
                            "again", answer.dropped)
            self.dropped += answer.dropped
        self._events.extend(Event(keys, removed, metadata_only)
                            for keys, removed, metadata_only in answer.events)

    def take(self) -> list[Event]:
        events, self._events = self._events, []
        return events
