"""The engine's own stores, from the slots it took until the daemon has heard they finished.

Until then the engine alone knows them: a lookup of such a key must not answer MISS (the
block is on its way) and a completed one is a HIT before the daemon marks it READY in the
index. Each store remembers its slot and what the stores of its step share: the reset epoch
they belong to (UNKNOWN_EPOCH while a reset this engine asked for is on its way: completions wait
for the reset's answer) and the step whose records told the daemon of it. A completed store
is forgotten once the daemon has read the step whose records carry its completion: until then
the index shows it being stored, and the engine answers its lookups HIT itself (vLLM's contract:
a block is loadable once `complete_store` returns, with no step or wait between).
A reset turns every store in flight stale: its completion is sent, failed, once the engine
says the copies in flight at the reset have finished.

A store that failed is gone for the engine at once: until the daemon has read the failure, the
index still shows the key being stored into that slot, and `failed` says that this state is
the engine's own dead store (its lookups answer MISS, a new offer of the key stores it again).

The common store, completion and settling run compiled where they were built
(kvd_proto/_steps.c, through the session's `Lookups`) on these same containers, whose shapes
kvd_proto/native.py names (`Store`, `StoreCall`, `SettleEntry`: the C reads them by position).
The methods here decide every case, and are the compiled steps' one Python twin: on the common
case they leave the containers as the C does (a store call's `StoreCall`, one `SettleEntry`
per step's stores completed together) and give the same records.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kvd_client.link.index_reader import STATE_READY
from kvd_proto import records as rec
from kvd_proto.native import MAX_EPOCH, SettleEntry, StepShared, Store, StoreCall

MAX_LOCAL_STORES = 1 << 16
UNKNOWN_EPOCH = -1              # a store made while a reset is on its way to the daemon


@dataclass(slots=True)
class Shared:
    """What the stores made in one step (under one reset epoch) share: a
    kvd_proto.native.StepShared (the compiled steps read both attributes by name)."""

    reset_epoch: int
    seq: int                    # the step whose records told the daemon about them


class StoreTracker:
    def __init__(self) -> None:
        self.stores: dict[bytes, Store] = {}       # key -> store (kvd_proto.native reads it)
        # of those, the copies that finished (a dict used as a set: the compiled paths reach
        # it by a key's hash without reading the key)
        self.completed: dict[bytes, None] = {}
        # completed stores in completion order, one entry per completion call and step its
        # stores were told in, to forget once the daemon has read the completion's step
        self._settling: collections.deque[SettleEntry] = collections.deque()
        self._stale: dict[int, list[bytes]] = {}   # reset epoch -> keys in flight at a reset
        self._deferred: list[tuple[bytes, str, bool]] = []   # completions awaiting an epoch
        # key -> the slot of its store that failed, until the daemon has read the failure
        self.failed: dict[bytes, int] = {}
        self._failing: collections.deque[tuple[int, bytes, int]] = collections.deque()
        self._shared: Shared | None = None
        # `settle`'s forgetting: the compiled one (kvd_proto/_steps.c) where the session has
        # it, else its twin below
        self.forget: Callable[[list[SettleEntry], dict[bytes, None]], None] = self._forget

    def _forget(self, entries: list[SettleEntry], completed: dict[bytes, None]) -> None:
        """Forget each entry's keys whose store is still that very one (the compiled
        `settle`'s Python twin)."""
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
            seq: int, call_of: str | None = None) -> None:
        """Stores of `new` into `slots`, told to the daemon with step `seq`'s records.
        `call_of`: the request of a store call the compiled store takes (one record's distinct
        keys): as it does, the record the call's whole successful completion sends is made
        now, while the keys are at hand (a `StoreCall`: `call_record`), where the epoch is
        known and the tracker holds them all."""
        stores = self.stores
        shared = self.shared(reset_epoch, seq)
        if len(new) <= MAX_LOCAL_STORES - len(stores):
            if call_of is not None and 0 <= reset_epoch <= MAX_EPOCH:
                call: StoreCall = (rec.encode_complete_store(new, True, call_of, reset_epoch),
                                   len(new))
                stores.update(zip(new, [(offset, shared, call) for offset in slots],
                                  strict=True))
            else:
                stores.update(zip(new, zip(slots, [shared] * len(new), strict=True),
                                  strict=True))
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

    def call_record(self, keys: Collection[bytes]) -> bytes | None:
        """The COMPLETE_STORE record made with one store call (`add`'s `call_of`) when `keys`
        are exactly that call's, each once, still in flight: what their whole successful
        completion sends, as the compiled completion does. None otherwise."""
        stores = self.stores
        call: StoreCall | None = None
        for key in keys:
            store = stores.get(key)
            if store is None or len(store) < 3:
                return None
            if call is None:
                call = store[2]
            elif store[2] is not call:
                return None
        if call is None or call[1] != len(keys) or len(set(keys)) != len(keys):
            return None
        return call[0]

    def complete(self, keys: Collection[bytes], req_id: str, success: bool, seq: int
                 ) -> tuple[dict[int, list[bytes]], int]:
        """Stores of `keys` finished: (keys per reset epoch to complete at the daemon; keys
        that were no store of this session). Those of an unknown epoch wait (`reset_done`).
        `seq`: the step whose records tell the daemon (a failure is the engine's own until
        then, see the module doc; and a success is answered HIT here until then). Successful
        ones settle together once the daemon has read step `seq`, one entry per run of keys
        whose stores were told in one step (as the compiled completion keeps them)."""
        by_reset: dict[int, list[bytes]] = {}
        stores, completed = self.stores, self.completed
        unknown = 0
        run: tuple[StepShared, list[bytes], list[Store]] | None = None   # the entry being made
        for key in keys:
            store = stores.get(key)
            if store is None:
                unknown += 1
                continue
            shared = store[1]
            if success:
                completed[key] = None        # lookups answer HIT from now on
                if run is None or run[0] is not shared:
                    self._settle_later(seq, run)
                    run = (shared, [], [])
                run[1].append(key)
                run[2].append(store)
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
        self._settle_later(seq, run)
        return by_reset, unknown

    def _settle_later(self, seq: int, run: tuple[StepShared, list[bytes], list[Store]] | None
                      ) -> None:
        if run is not None:
            self._settling.append((seq, tuple(run[1]), tuple(run[2])))

    def completing(self, entry: SettleEntry, seq: int) -> None:
        """Stores completed by the compiled path (kvd_proto/_steps.c `complete`, which put
        their keys in `completed` and answers (the step that told the daemon of them, keys,
        stores, the keys' hashes)): settled once the daemon has read step `seq`, whose records
        carry the completion."""
        self._settling.append((seq, *entry[1:]))

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
