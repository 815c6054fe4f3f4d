"""A namespace reset an engine asks for, from its request until the daemon's answer.

A reset drops every block of the namespace at the daemon; the engine cannot wait for it. From
the request on, the engine's lookups answer MISS (the index still shows what the reset drops)
and its new stores belong to an epoch it does not know yet (UNKNOWN_EPOCH): their completions
wait for the daemon's RESET_DONE, which names the new epoch. Copies that were in flight at the
reset finish harmlessly; once the engine says they have (`flushed`), their slots are released
at the daemon. Each request carries a token, so an answer to an earlier request (the engine
asked again meanwhile) is told apart from the one awaited.
"""

from __future__ import annotations

from collections.abc import Callable

from kvd_client.link import messages
from kvd_client.offload.loads import LoadTracker
from kvd_client.offload.stores import UNKNOWN_EPOCH, StoreTracker
from kvd_proto import records as rec

Put = Callable[[list[bytes]], None]


class Resets:
    """The reset this engine asked for (`pending`: its token, 0 when none) and the namespace's
    reset epoch its loads and stores belong to (see the module doc)."""

    def __init__(self, stores: StoreTracker, loads: LoadTracker) -> None:
        self._stores = stores
        self._loads = loads
        self.pending = 0
        self.epoch = 0
        self._tokens = 0

    @property
    def store_epoch(self) -> int:
        """The epoch of a store made now (UNKNOWN_EPOCH while a reset is on its way)."""
        return UNKNOWN_EPOCH if self.pending else self.epoch

    def follow(self, index_epoch: int) -> None:
        """A step starts: the index's epoch is the namespace's (unless a reset is pending)."""
        if not self.pending:
            self.epoch = index_epoch

    def clear(self) -> None:
        """A new session: no reset of the old one is awaited any more."""
        self.pending = 0

    def ask(self, put: Put) -> None:
        """Request a reset: every store and load in flight turns stale."""
        self._tokens += 1
        self.pending = self._tokens
        put([rec.encode_reset(self.pending)])
        self._stores.reset()
        self._loads.reset()

    def answered(self, answer: rec.DownRecord, put: Put, per_record: int) -> None:
        """A RESET_DONE (or a refused RESET) from the daemon."""
        if isinstance(answer, rec.ResetDone):
            if answer.token == self.pending:
                self._done(answer.epoch, put, per_record)
            else:                           # an earlier reset, asked again meanwhile
                self._stores.earlier_reset_done(answer.epoch)
        elif self.pending:                  # refused (logged): the epoch stays
            self._done(self.epoch, put, per_record)

    def _done(self, epoch: int, put: Put, per_record: int) -> None:
        """The daemon did the reset: the stores made meanwhile belong to its new epoch."""
        self.pending = 0
        self.epoch = epoch
        for key, req_id, success in self._stores.reset_done(epoch):
            put(messages.complete_store([key], success, req_id, epoch, per_record))

    def flushed(self, put: Put, per_record: int) -> None:
        """Every copy in flight at the last reset has finished: release their slots at the
        daemon (it kept them, as zombies, until now)."""
        for reset, keys in self._stores.reset_flushed().items():
            put(messages.complete_store(keys, False, "", reset, per_record))
        for reset, keys in self._loads.reset_flushed().items():
            for key in keys:          # one per load: a key may have several in flight
                put([rec.encode_complete_load([key], "", reset)])
