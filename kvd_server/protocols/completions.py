"""Where both engine protocols' loads and stores end: a session's pins and pending stores settled.

Loads and stores start differently on the call protocol (kvd_server/protocols/callpath.py: PrepareLoad,
PrepareStore) and on the shared-index protocol (kvd_server/protocols/fastpath.py: Pin, StoreGranted), but
both leave the same records on the session (`Session.pins`, `Session.pending`, keyed by epoch)
and end the same way: CompleteLoad and CompleteStore, as RPCs, StepStream ops or channel
records. Ownership is strict: a completion only releases the session's own pins and leases and
completes its own stores, so a buggy or hostile client cannot disturb another engine's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvd_server.errors import FailedPrecondition

if TYPE_CHECKING:
    from kvd_server.core.core import KvdCore
    from kvd_server.core.namespaces import Namespace
    from kvd_server.core.sessions import Session

# A completion naming an epoch this many resets behind the namespace finds no store bound
# after those resets (see Completions._bound_after_reset): a bound on the search.
MAX_RESETS_BEHIND = 64


class CompleteStoreResult(NamedTuple):
    ignored: bool
    completed: int
    mismatched: int


class Completions:
    """CompleteLoad and CompleteStore for either protocol (see the module doc)."""

    def __init__(self, core: KvdCore) -> None:
        self.core = core

    @staticmethod
    def _check_epoch(ns: Namespace, epoch: int) -> None:
        if epoch > ns.epoch:
            raise FailedPrecondition(f"epoch {epoch} is ahead of the namespace's epoch "
                                     f"{ns.epoch}")

    def complete_load(self, s: Session, keys: Sequence[bytes], req_id: str, epoch: int) -> bool:
        """Release this session's pins (or, for a key it leased but did not load, the lease);
        True when `epoch` is an earlier one (the completion only released zombies)."""
        core = self.core
        ns = core.namespace_of(s)
        self._check_epoch(ns, epoch)
        mgr = ns.mgr
        pins = s.pins
        released: list[bytes] = []
        pop = pins.pop
        for key in keys:
            pk = (epoch, key)
            count = pop(pk, 0)
            if not count:
                # Leased by this session and not loaded: the engine gives the lease back.
                core.leases.take_back(s, mgr, key, epoch)
                continue  # never touch another session's pin or lease
            if count > 1:
                pins[pk] = count - 1
            released.append(key)
        if released:
            mgr.complete_load(released, None, epoch)
            core.completed_load_bytes += len(released) * ns.layout.block_bytes
        stale = epoch < ns.epoch
        if stale:
            ns.release_extents()
        return stale

    def complete_store(self, s: Session, keys: Sequence[bytes], success: bool, req_id: str,
                       epoch: int, offsets: Sequence[int] | None = None) -> CompleteStoreResult:
        """Complete this session's pending stores of `keys` (others' are ignored); with
        `offsets` (the call protocol's CompleteStore), a key whose slot is not the one named
        is left pending and counted mismatched."""
        core = self.core
        ns = core.namespace_of(s)
        self._check_epoch(ns, epoch)
        own: list[bytes] = []
        own_slots: list[int] = []
        late: dict[int, tuple[list[bytes], list[int]]] = {}
        mismatched = 0
        if offsets is None and epoch == ns.epoch:      # the channel's completions: one pass
            pop = s.pending.pop
            for key in keys:
                slot = pop((epoch, key), None)
                if slot is not None:
                    own.append(key)
                    own_slots.append(slot)
            keys = ()
        for i, key in enumerate(keys):
            pk = (epoch, key)
            slot = s.pending.get(pk)
            if slot is None and epoch < ns.epoch:
                pk = self._bound_after_reset(s, ns.epoch, epoch, key)
                slot = None if pk is None else s.pending[pk]
            if slot is None:
                continue  # not this session's store (or already completed): ignored
            if offsets is not None and ns.slots.offset(slot) != offsets[i]:
                mismatched += 1
                continue
            del s.pending[pk]
            if pk[0] != epoch:
                group = late.setdefault(pk[0], ([], []))
                group[0].append(key)
                group[1].append(slot)
                continue
            own.append(key)
            own_slots.append(slot)
        for bound, (late_keys, late_slots) in late.items():
            # Stored under `epoch`, bound after a reset the engine had not seen yet: its bytes
            # belong to the dropped epoch, so the store fails (slot freed, key absent).
            ns.mgr.complete_store(late_keys, False, None, bound, slots=late_slots)
        if epoch < ns.epoch:
            ns.mgr.complete_store(own, success, None, epoch, slots=own_slots)
            ns.release_extents()
            return CompleteStoreResult(True, 0, mismatched)
        completed = ns.mgr.complete_store(own, success, None, epoch, slots=own_slots)
        core.completed_store_bytes += completed * ns.layout.block_bytes
        if s.hints and success:
            core.retention.touched(s, req_id, own)
        if not success:
            ns.release_extents()
        return CompleteStoreResult(False, completed, mismatched)

    @staticmethod
    def _bound_after_reset(s: Session, current: int, epoch: int,
                           key: bytes) -> tuple[int, bytes] | None:
        """The pending store of `key` that a completion naming the older `epoch` means: the
        engine stored it under `epoch` (the reset epoch it had read), and the daemon bound it
        after a reset it had not heard of yet, at a later epoch. One store of a key per epoch
        is pending at most, so the earliest later one is it (resets far behind: none)."""
        for later in range(epoch + 1, min(current, epoch + MAX_RESETS_BEHIND) + 1):
            if (later, key) in s.pending:
                return later, key
        return None
