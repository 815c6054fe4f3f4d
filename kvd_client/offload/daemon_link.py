"""What an offload session tells its daemon and what it hears back, on the scheduler thread.

`OffloadSession` (kvd_client/offload/session.py) decides; this puts its records into the
channel's outbox (dropped while the client is degraded: a new session starts from scratch),
flushes them at a step's end, applies the daemon's answers (grants, events, reset answers;
completed stores it has read) and reports the lookup counts the daemon's stats show. Nothing
here waits for the daemon either: a daemon that stops reading is noticed by the outbox
overflowing, and the session is restarted.
"""

from __future__ import annotations

import logging
import time

from kvd_client.client import KvdClient
from kvd_client.link.channel import Messenger
from kvd_client.offload.event_inbox import EventInbox
from kvd_client.offload.reserve import StoreReserve
from kvd_client.offload.resets import Resets
from kvd_client.offload.stores import StoreTracker
from kvd_proto import records as rec

log = logging.getLogger(__name__)

# Lookup counts go to the daemon at most this often while the engine steps (and whenever it
# asks whether work is pending, and at close): a COUNTERS record every step was the only
# record of most quiet steps, and each one woke an idle daemon (a write to its eventfd, and
# its process scheduled) for figures no one reads that often.
COUNTS_INTERVAL_S = 0.25


class DaemonLink:
    """One session's records and answers (see the module doc). `msgs` is the session's
    Messenger: its step (`seq`), what the daemon has read (`acked`) and the channel."""

    def __init__(self, client: KvdClient, msgs: Messenger, reserve: StoreReserve,
                 events: EventInbox, resets: Resets, stores: StoreTracker) -> None:
        self.client = client
        self.msgs = msgs
        self._reserve = reserve
        self._events = events
        self._resets = resets
        self._stores = stores
        self._reported = (0, 0, 0)        # lookups, hits, misses the daemon has heard of
        self._reported_at = 0.0
        # The records made since the last `stage`, in order. The scheduler's compiled calls
        # append theirs straight to this list (`records.append`, bound once: a call's record
        # costs one append, not two Python calls); everything else goes through `put`. So
        # the list is only ever changed in place. `_optional`: how many are not essential.
        self.records: list[bytes] = []
        self._optional = 0

    def put(self, records: list[bytes], essential: bool = True) -> None:
        """Queue records for the step being made (essential: ones the engine waits for);
        dropped while the client is degraded or has no channel."""
        if records and self.client.available and self.msgs.channel is not None:
            self.records += records
            if not essential:
                self._optional += len(records)

    @property
    def essential(self) -> bool:
        """Whether the step being made has a record the engine waits for."""
        return len(self.records) > self._optional or self.msgs.essential

    def stage(self) -> None:
        """The records made so far into the outbox, as the current step's (dropped while the
        client is degraded or has no channel: a new session starts from scratch)."""
        records, msgs = self.records, self.msgs
        if records:
            if self.client.available and msgs.channel is not None:
                essential = len(records) > self._optional
                msgs.outbox.put_many(msgs.seq, records, essential)
                msgs.essential |= essential
            records.clear()
        self._optional = 0

    def drop(self) -> None:
        """Forget the records not staged yet (the session they were made for has ended)."""
        self.records.clear()
        self._optional = 0

    def unread(self) -> bool:
        """Records the engine waits for that the daemon has not read (staging and flushing
        what waits)."""
        self.stage()
        return self.msgs.unread()

    def flush(self) -> None:
        """Into the ring what fits; a daemon that reads none of it restarts the session."""
        self.stage()
        if not self.msgs.flush():
            log.error("kvd daemon reads none of this engine's messages (%d waiting); "
                      "restarting the session", self.msgs.outbox.waiting())
            self.msgs.attach(self.msgs.channel)
            self.client.drop_session("the daemon does not keep up with this engine's messages")

    def receive(self, per_record: int) -> None:
        """Apply what the daemon answered since the last call."""
        for answer in self.msgs.receive():
            if isinstance(answer, rec.Granted):
                self._reserve.granted(answer.offsets)
            elif isinstance(answer, rec.Events):
                self._events.add(answer)
            elif isinstance(answer, rec.ResetDone) or answer.kind == rec.RESET:
                self._resets.answered(answer, self.put, per_record)
        self._stores.settle(self.msgs.acked)

    def report_counts(self, counts: tuple[int, int, int], at_once: bool = True) -> None:
        """The lookups, hits and misses answered so far: what the daemon has not heard of
        goes as one COUNTERS record (nothing when they did not move; with `at_once` False,
        also nothing within COUNTS_INTERVAL_S of the last one)."""
        if counts != self._reported:
            if not at_once:
                clock = time.monotonic()
                if clock - self._reported_at < COUNTS_INTERVAL_S:
                    return
                self._reported_at = clock
            delta = [new - old for new, old in zip(counts, self._reported, strict=True)]
            self._reported = counts
            self.put([rec.encode_counters(*delta)], essential=False)
