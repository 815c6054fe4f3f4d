"""A session's one link to its daemon, on the scheduler thread: what it tells the daemon and
what it hears back.

`OffloadSession` (kvd_client/offload/session.py) decides; this holds the current connection's
channel (kvd_client/link/channel.py, the transport: rings and the outbox of records the ring
had no room for), puts the session's records into the outbox as the step's (`seq`; dropped
while the client is degraded or not connected: a new session starts from scratch), flushes
them at a step's end, follows which steps the daemon has read (`acked`), applies its answers
(grants, events, reset answers; completed stores it has read; refusals counted and logged)
and reports the lookup counts the daemon's stats show. Nothing here waits for the daemon
either: a daemon that stops reading is noticed by the outbox overflowing, and the session is
restarted. Here and not in link/ because the answers go to the offload trackers (link/ never
imports offload/).
"""

from __future__ import annotations

import logging
import time

from kvd_client.client import KvdClient
from kvd_client.link.channel import Outbox, SessionChannel
from kvd_client.offload.event_inbox import EventInbox
from kvd_client.offload.finds import Finds
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
REJECTED_LOG_INTERVAL_S = 10.0     # refused records are logged at most this often


class DaemonLink:
    """One session's records, channel and answers (see the module doc): the step whose records
    are being made (`seq`), the last one whose records the daemon has read (`acked`), the
    current connection's `channel` (None: not connected)."""

    def __init__(self, client: KvdClient, reserve: StoreReserve, events: EventInbox,
                 resets: Resets, stores: StoreTracker, finds: Finds | None = None) -> None:
        self.client = client
        self._finds = finds or Finds()
        self._reserve = reserve
        self._events = events
        self._resets = resets
        self._stores = stores
        self.outbox = Outbox()
        self.channel: SessionChannel | None = None
        self.seq = 0                  # the step whose records are being made
        self.acked = -1               # the last step whose records the daemon has read
        self.rejected = 0             # records the daemon refused (a bug here, or stale)
        self._rejected_logged_at = 0.0
        self._reported = (0, 0, 0)        # lookups, hits, misses the daemon has heard of
        self._reported_at = 0.0
        # The records made since the last `stage`, in order. The scheduler's compiled calls
        # append theirs straight to this list (`records.append`, bound once: a call's record
        # costs one append, not two Python calls); everything else goes through `put`. So
        # the list is only ever changed in place. `_optional`: how many are not essential.
        self.records: list[bytes] = []
        self._optional = 0
        self._staged_essential = False    # this step staged a record the engine waits for

    @property
    def sent(self) -> int:
        """Records written into the channel so far (every connection)."""
        return self.outbox.sent

    def attach(self, channel: SessionChannel | None) -> None:
        """A new connection's channel (None: none); what waited for the old one is gone."""
        self.outbox.clear()
        self.channel = channel

    def put(self, records: list[bytes], essential: bool = True) -> None:
        """Queue records for the step being made (essential: ones the engine waits for);
        dropped while the client is degraded or has no channel."""
        if records and self.client.available and self.channel is not None:
            self.records += records
            if not essential:
                self._optional += len(records)

    @property
    def essential(self) -> bool:
        """Whether the step being made has a record the engine waits for."""
        return len(self.records) > self._optional or self._staged_essential

    def stage(self) -> None:
        """The records made so far into the outbox, as the current step's (dropped while the
        client is degraded or has no channel: a new session starts from scratch)."""
        records = self.records
        if records:
            if self.client.available and self.channel is not None:
                essential = len(records) > self._optional
                self.outbox.put_many(self.seq, records, essential)
                self._staged_essential |= essential
            records.clear()
        self._optional = 0

    def drop(self) -> None:
        """Forget the records not staged yet (the session they were made for has ended)."""
        self.records.clear()
        self._optional = 0

    def discard(self) -> None:
        """Forget every record the daemon has not read, staged or not (none of them will be
        read: the client is degraded)."""
        self.drop()
        self.outbox.clear()

    def unread(self) -> bool:
        """Records the engine waits for that the daemon has not read (staging and flushing
        what waits)."""
        self.stage()
        channel = self.channel
        if channel is not None and self.outbox.waiting():
            self.outbox.flush(channel)
        return self.outbox.unread(channel)

    def flush(self, *, restart: bool = True) -> None:
        """Stage, and into the ring what fits. With `restart`, a daemon that reads none of it
        (so much waits that it cannot be reading) restarts the session."""
        self.stage()
        channel = self.channel
        if channel is None:
            return
        self.outbox.flush(channel)
        if restart and self.outbox.overflowing:
            log.error("kvd daemon reads none of this engine's messages (%d waiting); "
                      "restarting the session", self.outbox.waiting())
            self.outbox.clear()
            self.client.drop_session("the daemon does not keep up with this engine's messages")

    def next_step(self) -> None:
        """The step's records are out: the next step's begin."""
        self.seq += 1
        self._staged_essential = False

    def receive(self, per_record: int) -> None:
        """Apply what the daemon answered since the last call (`acked` moves with what it
        read). A refused record is counted and logged (at most every
        REJECTED_LOG_INTERVAL_S): the rest goes on."""
        channel = self.channel
        if channel is not None:
            answers = channel.receive(self._reserve.granted_record)
            self.acked = self.outbox.acked(channel, self.seq)
            for answer in answers:
                if isinstance(answer, rec.Granted):
                    self._reserve.granted(answer.offsets, answer.kept_index,
                                          answer.kept_keys)
                elif isinstance(answer, rec.Events):
                    self._events.add(answer)
                elif isinstance(answer, rec.Rejected):
                    self._refused(answer)
                    if answer.kind == rec.RESET:
                        self._resets.answered(answer, self.put, per_record)
                elif isinstance(answer, rec.ResetDone):
                    self._resets.answered(answer, self.put, per_record)
                elif isinstance(answer, rec.Found):
                    self._finds.found(answer.step)
        self._stores.settle(self.acked)
        self._reserve.restored(self.acked)

    def _refused(self, answer: rec.Rejected) -> None:
        self.rejected += 1
        now = time.monotonic()
        if now - self._rejected_logged_at > REJECTED_LOG_INTERVAL_S:
            self._rejected_logged_at = now
            log.warning("kvd rejected a %s message: %s: %s (%d so far)",
                        rec.UP_KINDS.get(answer.kind, answer.kind), answer.code,
                        answer.message, self.rejected)

    def counts_due(self) -> bool:
        """Whether a step's end may report the counts now (`report_counts` with `at_once`
        False sends nothing within COUNTS_INTERVAL_S of the last report): checked first, the
        counts are not even gathered on the steps in between."""
        return time.monotonic() - self._reported_at >= COUNTS_INTERVAL_S

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
