"""The scheduler's load and store calls of an `OffloadSession` (kvd_client/offload/session.py),
the part of the session a vLLM step calls a few times each: start and finish loads of this
step's HITs, take granted slots for new keys, complete stores.

Where the extension was built, each call's common case runs compiled in one pass over its keys
(kvd_proto/_steps.c, methods of the session's `Lookups`: `pin`, `store`, `complete`), on the
same containers the Python trackers keep (loads.py, stores.py, reserve.py beside it);
everything else (a key that was no HIT, a key named twice, a failed store, a reset on its way,
more keys than one record carries, a short reserve) goes the Python way below. That way
decides every case, and it is the compiled steps' one Python twin (there is no other: the
session on the twins, KVD_NATIVE=0, runs only it): on the common case it answers, leaves the
containers and writes the records exactly as the C does, the one record a call's whole
completion sends included (made at its store or pin), which
tests/unit/test_steps_differential.py holds it to. Nothing here waits for the daemon: what it
must hear is put with the step's records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvd_client.client import KvdClient
from kvd_client.link import messages
from kvd_client.link.index_reader import IndexReader
from kvd_client.offload.daemon_link import DaemonLink
from kvd_client.offload.loads import LoadTracker
from kvd_client.offload.old_copies import OldCopies
from kvd_client.offload.reserve import StoreReserve
from kvd_client.offload.resets import Resets
from kvd_client.offload.stores import MAX_LOCAL_STORES, StoreTracker
from kvd_proto import records as rec
from kvd_proto.native import CompiledSteps, IndexLookups

log = logging.getLogger(__name__)


class SessionTransfers:
    """Loads and stores of an `OffloadSession`, its base class: the attributes below are the
    session's (set by its constructor and its connection's adoption)."""

    client: KvdClient
    _lookups: IndexLookups
    _steps: CompiledSteps | None     # the same, where its steps are compiled
    _loads: LoadTracker
    _stores: StoreTracker
    _reserve: StoreReserve
    _resets: Resets
    _link: DaemonLink
    _old: OldCopies
    _index: IndexReader | None
    _in_step: bool
    _step_epoch: int
    _per_record: int
    _put: Callable[..., None]
    _post: Callable[[bytes], None]
    _begin: Callable[[], None]
    _publish_idle: Callable[[], None]

    # ------------------------------------------------------------------ loads
    def start_loads(self, keys: Sequence[bytes], req_id: str = "",
                    positions: Sequence[int] | None = None, missing: Any = None
                    ) -> list[Any]:
        """Start loads of keys this step's lookups found HIT: their offsets (`missing` for a
        key that was not: the engine asked for a load it may not make, logged as an error).
        The slots stay readable until `finish_loads`. (The daemon hears of them as a PIN
        record: to its eviction order they are pinned while they load.)"""
        if not self._in_step:
            self._begin()
        if not keys:
            return []
        reset = self._resets.epoch
        epochs = (self._step_epoch, reset, req_id)
        steps = self._steps
        if steps is not None:       # the common case, compiled (kvd_proto/_steps.c)
            pinned = steps.pin(keys, positions, req_id, self._per_record, reset)
            if pinned is not None:
                found, keyset, record, completion = pinned
                self._loads.start_distinct(keyset, epochs, completion)
                self._post(record)
                return found
        offsets: list[Any] = list(map(self._lookups.hit_offset, keys))
        loaded = [k for k, o in zip(keys, offsets, strict=True) if o is not None]
        loaded_offsets = [o for o in offsets if o is not None]
        pos = positions if positions and len(positions) == len(keys) else None
        if len(loaded) < len(keys):
            log.error("a load of %d keys kvd did not answer HIT this step (of %d); they are "
                      "not loaded", len(keys) - len(loaded), len(keys))
            if pos:
                pos = [p for p, o in zip(pos, offsets, strict=True) if o is not None]
            if missing is not None:
                offsets = [missing if o is None else o for o in offsets]
            if not loaded:
                return offsets
            done: bytes | None = None
        else:
            # Every key a HIT: the pin's whole completion is made now, while the keys are at
            # hand, as the compiled pin makes it (kept where they are one record's, distinct).
            done = rec.encode_complete_load(loaded, req_id, reset) \
                if len(loaded) <= self._per_record else None
        distinct = self._loads.start(loaded, epochs, done)
        self._put(messages.pin(loaded, req_id, pos, loaded_offsets, self._per_record, distinct))
        return offsets

    def finish_loads(self, keys: Sequence[bytes], req_id: str = "") -> None:
        """Loads of `keys` finished (every worker copied)."""
        done = self._loads.finish_whole(keys, req_id)
        if done is not None:        # a whole pin, its completion made with it
            if not self._loads.holding:
                self._publish_idle()
            self._post(done)
            return
        by_reset, unknown = self._loads.finish(keys, req_id)
        if unknown:
            self._put(self._old.finished_records(unknown))
        if not self._loads.holding:
            self._publish_idle()
        for reset, group in by_reset.items():
            self._put(messages.complete_load(group, req_id, reset, self._per_record,
                                             distinct=True))

    # ----------------------------------------------------------------- stores
    def reserve(self, keys: Sequence[bytes], req_id: str = "",
                positions: Sequence[int] | None = None) -> list[tuple[bytes, int]] | None:
        """Slots for the offered keys that are new: [(key, offset)] (keys stored or being
        stored already are left out), or None when the reserve cannot hold them all now."""
        stored = self.store_slots(keys, req_id, positions)
        return None if stored is None else list(zip(*stored, strict=True))

    def store_slots(self, keys: Sequence[bytes], req_id: str = "",
                    positions: Sequence[int] | None = None
                    ) -> tuple[list[bytes], list[int]] | None:
        """`reserve` as two lists: the new keys and their slots' offsets (what an engine's
        store spec wants), or None when the reserve cannot hold them all now."""
        if not self._in_step:
            self._begin()
        stores = self._stores
        steps = self._steps
        if steps is not None and self._lookups.enabled and not stores.failed and \
                self.client.available:
            # The common case in one compiled pass (kvd_proto/_steps.c); None: this path.
            done = steps.store(keys, positions, req_id, self._reserve.slots,
                               stores.shared(self._resets.store_epoch, self._link.seq),
                               self._per_record, MAX_LOCAL_STORES - len(stores.stores))
            if done is not None:
                new, taken, record = done
                self._reserve.took(taken)
                if record is not None:
                    self._post(record)
                return new, taken
        if self._index is None or not self.client.available:
            return [], []
        new = self.new_keys(keys)
        slots = self._reserve.take(len(new))
        if slots is None:
            return None
        if not new:
            return new, slots
        # A call the compiled store takes (one record's distinct keys, no failed store of
        # this engine waiting) makes, as it does, the record of its whole completion. During
        # a reset this session asked for, the stores' epoch is the reset's answer:
        # UNKNOWN_EPOCH until it arrives (and no such record is made).
        one_call = not stores.failed and len(keys) <= self._per_record and \
            all(type(key) is bytes for key in keys) and len(set(keys)) == len(keys)
        stores.add(new, slots, self._resets.store_epoch, self._link.seq,
                   req_id if one_call else None)
        pos = positions if positions and len(positions) == len(keys) else None
        self._put(messages.store(keys, req_id, pos, new, slots, self._per_record))
        return new, slots

    def new_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys neither stored nor being stored, as `store_slots` decides (it starts the
        step the same way: the daemon's answers applied); none without a daemon. Until the
        daemon has done a reset this session asked for, the index still shows what the reset
        drops: only this session's own later stores count as present."""
        self._begin()
        if self._index is None or not self.client.available:
            return []
        use_index = not self._resets.pending
        return self._stores.new_keys(keys, self._lookups.find_new(keys, use_index),
                                     self._lookups.find if use_index else None)

    @property
    def capacity(self) -> int:
        """The namespace's slots (0 before the session has its index)."""
        return 0 if self._index is None else self._index.header.capacity

    @property
    def stores_in_flight(self) -> int:
        """This engine's stores not completed yet."""
        return len(self._stores.stores) - len(self._stores.completed)

    @property
    def loads_in_flight(self) -> int:
        """Blocks this engine is loading (started, not finished yet)."""
        return self._loads.in_flight

    def complete_store(self, keys: Sequence[bytes], req_id: str = "",
                       success: bool = True) -> None:
        """Stores of `keys` finished (every worker wrote its share). A failed one is gone for
        this engine at once: its lookups answer MISS and an offer stores it again."""
        stores = self._stores
        steps = self._steps
        if success and steps is not None:   # the common case, compiled (kvd_proto/_steps.c)
            done = steps.complete(keys, stores.completed, req_id, self._per_record)
            if done is not None:
                entry, record = done
                stores.completing(entry, self._link.seq)
                self._post(record)
                return
        # Exactly one store call's keys: the record made with it, as the compiled one sends.
        whole = stores.call_record(keys) if success else None
        by_reset, unknown = stores.complete(keys, req_id, success, self._link.seq)
        if whole is not None:
            self._put([whole])
            return
        if unknown:
            self._put(self._old.finished_records(unknown))
        for reset, group in by_reset.items():
            self._put(messages.complete_store(group, success, req_id, reset, self._per_record))

