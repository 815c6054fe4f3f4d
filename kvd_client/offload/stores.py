"""The engine's own stores, from the slots it took until the daemon has heard they finished.

Until then the engine alone knows them: a lookup of such a key must not answer MISS (the
block is on its way) and a completed one is a HIT before the daemon marks it READY in the
index. Each store remembers its slot and what the stores of its step share: the reset epoch
they belong to (UNKNOWN_EPOCH while a reset this engine asked for is on its way: completions wait
for the reset's answer) and the step whose records told the daemon of it. A completed store
is forgotten once the daemon has read that step's records (the index answers from then on).
A reset turns every store in flight stale: its completion is sent, failed, once the engine
says the copies in flight at the reset have finished.

A store that failed is gone for the engine at once: until the daemon has read the failure, the
index still shows the key being stored into that slot, and `failed` says that this state is
the engine's own dead store (its lookups answer MISS, a new offer of the key stores it again).

The common store, completion and settling run compiled (kvd_proto/_steps.c, through the
session's `Lookups`) on these same containers; the methods here decide every other case.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvd_client.link.index_reader import STATE_READY

MAX_LOCAL_STORES = 1 << 16
UNKNOWN_EPOCH = -1              # a store made while a reset is on its way to the daemon


@dataclass(slots=True)
class Shared:
    """What the stores made in one step (under one reset epoch) share."""

    reset_epoch: int
    seq: int                    # the step whose records told the daemon about them


# A store in flight: (slot offset, its step's record), and, made by the compiled store path,
# (its call's COMPLETE_STORE record, the call's key count) third.
Store = tuple[Any, ...]


class StoreTracker:
    def __init__(self) -> None:
        self.stores: dict[bytes, Store] = {}       # key -> store (kvd_proto.native reads it)
        # of those, the copies that finished (a dict used as a set: the compiled paths reach
        # it by a key's hash without reading the key)
        self.completed: dict[bytes, None] = {}
        # completed stores in completion order, (seq, keys, their stores[, their hashes]) per
        # completion, to forget once the daemon has read them
        self._settling: collections.deque[tuple[Any, ...]] = collections.deque()
        self._stale: dict[int, list[bytes]] = {}   # reset epoch -> keys in flight at a reset
        self._deferred: list[tuple[bytes, str, bool]] = []   # completions awaiting an epoch
        # key -> the slot of its store that failed, until the daemon has read the failure
        self.failed: dict[bytes, int] = {}
        self._failing: collections.deque[tuple[int, bytes, int]] = collections.deque()
        self._shared: Shared | None = None
        self.forget: Callable[[list, set[bytes]], None] = self._forget

    def _forget(self, entries: list[tuple], completed: dict[bytes, None]) -> None:
        """`settle`'s forgetting, where no compiled one was given (the same effects)."""
        stores = self.stores
        for entry in entries:
            for key, store in zip(entry[1], entry[2], strict=True):
                if stores.get(key) is store:
                    del stores[key]
                    completed.pop(key, None)

    def __len__(self) -> int:
        return len(self.stores)

    def shared(self, reset_epoch: int, seq: int) -> Shared:
        """The record the stores made now share: one per step and reset epoch (a completion
        of stores made by several calls of one step is as common as of one call's)."""
        shared = self._shared
        if shared is None or shared.seq != seq or shared.reset_epoch != reset_epoch:
            shared = self._shared = Shared(reset_epoch, seq)
        return shared

    def add(self, new: Sequence[bytes], slots: Sequence[int], reset_epoch: int,
            seq: int) -> None:
        """Stores of `new` into `slots`, told to the daemon with step `seq`'s records."""
        stores = self.stores
        shared = self.shared(reset_epoch, seq)
        if len(new) <= MAX_LOCAL_STORES - len(stores):
            stores.update(zip(new, zip(slots, [shared] * len(new), strict=True), strict=True))
        else:
            for key, offset in zip(new[:max(0, MAX_LOCAL_STORES - len(stores))], slots,
                                   strict=False):
                stores[key] = (offset, shared)

    def answer(self, key: bytes, found: tuple[int, int] | None, acked: int
               ) -> int | None | bool:
        """How this engine's own stores answer a lookup of `key` the index alone does not
        decide (`found`: the index's (state, offset), not READY, or None; `acked`: the last
        step the daemon read): the offset to load (a HIT), True (being stored: PENDING) or
        None (a MISS)."""
        store = self.stores.get(key)
        if found is not None:
            offset = found[1]
            if store is not None and store[0] == offset and key in self.completed:
                return offset                     # ours, completed: the daemon catches up
            if self.failed.get(key) == offset:
                return None                       # ours, failed: the daemon catches up
            return True
        if store is not None and store[1].seq > acked:
            # The daemon has not read this store yet: the slot is still ours alone.
            return store[0] if key in self.completed else True
        return None

    def new_keys(self, keys: Sequence[bytes], new: list[bytes],
                 find: Callable[[bytes], tuple[int, int] | None] | None) -> list[bytes]:
        """`new` (the keys neither stored here nor in the index: `Lookups.find_new`), where a
        store of this engine failed and the daemon has not read it yet: a key the index shows
        being stored into the failed slot is new again (`find`: the index's probe, None
        while a reset makes the index moot)."""
        if not self.failed or len(new) == len(keys):
            return new
        stores, failed = self.stores, self.failed
        out = []
        for key in keys:
            if key in stores:
                continue
            found = find(key) if find is not None else None
            if found is None or (found[0] != STATE_READY and failed.get(key) == found[1]):
                out.append(key)
        return out

    def complete(self, keys: Sequence[bytes], req_id: str, success: bool, seq: int = 0
                 ) -> tuple[dict[int, list[bytes]], int]:
        """Stores of `keys` finished: (keys per reset epoch to complete at the daemon; keys
        that were no store of this session). Those of an unknown epoch wait (`reset_done`).
        `seq`: the step whose records tell the daemon (a failure is the engine's own until
        then, see the module doc)."""
        by_reset: dict[int, list[bytes]] = {}
        stores, completed, settling = self.stores, self.completed, self._settling
        unknown = 0
        for key in keys:
            store = stores.get(key)
            if store is None:
                unknown += 1
                continue
            shared = store[1]
            if success:
                completed[key] = None        # lookups answer HIT from now on
                settling.append((shared.seq, (key,), (store,)))
            else:
                del stores[key]
                completed.pop(key, None)
                if len(self.failed) < MAX_LOCAL_STORES:
                    self.failed[key] = store[0]
                    self._failing.append((seq, key, store[0]))
            if shared.reset_epoch == UNKNOWN_EPOCH:
                self._deferred.append((key, req_id, success))
                continue
            by_reset.setdefault(shared.reset_epoch, []).append(key)
        return by_reset, unknown

    def completing(self, entry: tuple[Any, ...]) -> None:
        """Stores completed by the compiled path (kvd_proto/_steps.c `complete`, which put
        their keys in `completed`): (the step that told the daemon of them, keys, stores, the
        keys' hashes)."""
        self._settling.append(entry)

    def settle(self, acked: int) -> None:
        """Completed stores the daemon has read are answered by the index from now on (in
        completion order: one not read yet keeps the later ones a little longer, which only
        sends their lookups down the slow path). Each key is forgotten if its store is still
        the completed one (`forget`: kvd_proto/native.py's Lookups.settle, compiled)."""
        settling = self._settling
        if settling and settling[0][0] <= acked:
            read = []
            while settling and settling[0][0] <= acked:
                read.append(settling.popleft())
            self.forget(read, self.completed)
        failing, failed = self._failing, self.failed
        while failing and failing[0][0] <= acked:
            _, key, offset = failing.popleft()
            if failed.get(key) == offset:
                del failed[key]

    def reset(self) -> None:
        """A reset: every store in flight is stale (its slot waits at the daemon)."""
        for key, store in self.stores.items():
            self._stale.setdefault(store[1].reset_epoch, []).append(key)
        self._clear()

    def reset_done(self, epoch: int) -> list[tuple[bytes, str, bool]]:
        """The daemon did the reset: stores made meanwhile belong to `epoch`; the completions
        that waited for it, to send now."""
        for store in self.stores.values():
            if store[1].reset_epoch == UNKNOWN_EPOCH:
                store[1].reset_epoch = epoch
        deferred, self._deferred = self._deferred, []
        return deferred

    def reset_flushed(self) -> dict[int, list[bytes]]:
        """The copies in flight at the last reset finished: the stale stores to fail, by the
        epoch the daemon bound them in. Stores made while an earlier reset of this engine was
        on its way have no known epoch yet: they wait for that reset's answer
        (`earlier_reset_done`), or for the session to end (the daemon lets go of them)."""
        stale, self._stale = self._stale, {}
        unknown = stale.pop(UNKNOWN_EPOCH, None)
        if unknown:
            self._stale[UNKNOWN_EPOCH] = unknown
        return stale

    def earlier_reset_done(self, epoch: int) -> None:
        """An earlier reset of this engine (not the last one asked for) was done at `epoch`:
        the stores made while it was on its way were bound in that epoch."""
        unknown = self._stale.pop(UNKNOWN_EPOCH, None)
        if unknown:
            self._stale.setdefault(epoch, []).extend(unknown)

    def _clear(self) -> None:
        self._shared = None
        self.stores.clear()
        self.completed.clear()
        self._settling.clear()
        self.failed.clear()
        self._failing.clear()

    def clear(self) -> None:
        """A new session: nothing of the old one is tracked here any more."""
        self._clear()
        self._stale.clear()
        self._deferred.clear()
