"""The shared-index protocol: what an engine that maps its namespace's index tells the daemon.

Such an engine answers lookups from the index itself, keeps its loads safe with its published
epoch and stores into slots granted in advance; the daemon only hears about it afterwards
(Grant, StoreGranted, Pin, and the usual completions), over StepStream ops or, without any
engine thread, over the session's channel (kvd_server/channel/hub.py). `FastPath` is those
operations on the core's sessions and namespaces. Every session's reserve (the slots it wants
to hold granted) is accounted on its namespace as it changes, so no call scans the sessions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvd_proto.wire import MAX_GRANTED_SLOTS
from kvd_server.core.namespaces import reserve_owed
from kvd_server.core.sessions import MAX_PENDING_STORES_PER_SESSION
from kvd_server.errors import FailedPrecondition

if TYPE_CHECKING:
    from kvd_server.core.core import KvdCore
    from kvd_server.core.namespaces import Namespace
    from kvd_server.core.sessions import Session
    from kvd_server.protocols.callpath import Below


class GrantedSlots(NamedTuple):
    """A top-up: the slots' offsets, and which of them (`kept_index` into them) still hold
    an evicted block (`kept_keys`)."""

    offsets: list[int]
    kept_index: list[int]
    kept_keys: list[bytes]


NO_SLOTS = GrantedSlots([], [], [])
# Slots one top-up grants a session that is told the blocks they hold: its GRANTED record
# (8 + 4 + up to 129 bytes a slot) stays within the down ring's largest record (512 KiB).
MAX_KEPT_GRANT = 2048


class StoreGrantedAnswer(NamedTuple):
    accepted: int
    duplicates: int
    refused: int
    evicted: list[bytes]
    epoch: int


class FastPath:
    """The shared-index protocol's operations (see the module doc); runs on the event loop."""

    def __init__(self, core: KvdCore, below: Below | None = None) -> None:
        self.core = core
        self.below = below

    def _ns(self, s: Session) -> Namespace:
        return self.core.namespace_of(s)

    # ------------------------------------------------------------------ the index
    def attach_index(self, s: Session) -> tuple[int, int]:
        """Make `s` a reader of its namespace's index: (index fd, the session's marks fd).
        The daemon keeps both; the attach server passes duplicates of them."""
        ns = self._ns(s)
        if ns.index is None or ns.reclaim is None:
            raise FailedPrecondition("this namespace has no shared index")
        marks = ns.reclaim.add_reader(s.id, s.peer.pid)     # named if it holds reuse back
        s.reader = True
        return ns.index.fd, marks.fd

    # ------------------------------------------------------------------ operations
    def grant(self, s: Session, count: int, evict: bool = False) -> list[int]:
        """Up to `count` more free slots for the session's future stores; their offsets.

        The session's reserve target becomes what it holds plus `count`; its next stores
        evict for it (store_granted: at the point vLLM's prepare_store evicts, so the victims
        are the same). With `evict` (the session declined a store for want of slots, so no
        store would come to make room) and the namespace short of room (free and soon-free
        slots less every session's owed reserve), ready blocks are evicted for it now.
        Evicted slots come back once every reader has moved past them: a grant may give fewer
        than asked, and the session asks again later."""
        ns = self._ns(s)
        before = (s.reserve_target, reserve_owed(s))
        s.reserve_target = min(MAX_GRANTED_SLOTS, len(s.granted) + count)
        ns.carry_reserve(s, *before)
        if self.core.draining:
            return []
        count = max(0, min(count, MAX_GRANTED_SLOTS - len(s.granted)))
        if not count:
            return []
        if evict and ns.slots.free_count() < count:
            ns.mgr.make_room(0, (), ns.reserve_owed)     # all or nothing: maybe none
        count = min(count, ns.free_for_reserves())
        if not count:
            return []
        before = (s.reserve_target, reserve_owed(s))
        slots = ns.slots.allocate(count)
        s.granted.update(slots)
        ns.carry_reserve(s, *before)
        return ns.slots.offsets(slots)

    def set_reserve(self, s: Session, target: int, evict: bool = False,
                    kept: bool = False) -> None:
        """The session wants `target` slots held granted (the channel's RESERVE): `top_up`
        hands them out as they come free. Its stores evict for them (store_granted, where
        vLLM's prepare_store evicts); with `evict` (it declined a store for want of slots,
        so no store would come) ready blocks are evicted for them now."""
        ns = self._ns(s)
        s.wants_kept = kept
        before = (s.reserve_target, reserve_owed(s))
        s.reserve_target = min(MAX_GRANTED_SLOTS, target)
        ns.carry_reserve(s, *before)
        if evict and reserve_owed(s) and not self.core.draining:
            ns.mgr.make_room(0, (), ns.reserve_owed)     # all or nothing: maybe none

    def top_up(self, s: Session) -> list[int]:
        """Free slots up to the session's reserve target (none while draining): offsets."""
        return self.top_up_kept(s).offsets

    def top_up_kept(self, s: Session) -> GrantedSlots:
        """`top_up`, and (for a session that asked, RESERVE flag 2) which of the slots still
        hold the block evicted from them: the session may take those back (`restore`)
        where its own lookups would have hit them had the eviction waited until it stored
        into them, as vLLM's prepare_store waits."""
        owed = reserve_owed(s)
        if not owed or self.core.draining or s.ns is None:
            return NO_SLOTS
        ns = s.ns
        count = min(owed, ns.free_for_reserves())
        if s.wants_kept:
            count = min(count, MAX_KEPT_GRANT)     # one GRANTED record, keys and all
        if count <= 0:
            return NO_SLOTS
        before = (s.reserve_target, owed)
        kept: list[bytes | None] | None = [] if s.wants_kept else None
        slots = ns.slots.allocate(count, kept)
        s.granted.update(slots)
        ns.carry_reserve(s, *before)
        offsets = ns.slots.offsets(slots)
        if not kept:
            return GrantedSlots(offsets, [], [])
        index = [i for i, key in enumerate(kept) if key is not None]
        keys = [kept[i] for i in index]
        s.kept.update((slots[i], key) for i, key in zip(index, keys, strict=True))
        return GrantedSlots(offsets, index, keys)  # type: ignore[arg-type]

    def restore(self, s: Session, keys: Sequence[bytes], offsets: Sequence[int]) -> int:
        """Granted slots the session takes back as the blocks GRANTED said they still hold
        (RESTORE): each leaves the reserve and is its block, READY, again; a slot whose key
        does not match what was named, or whose key was stored again meanwhile, is freed
        (it was never written). How many blocks came back."""
        ns = self._ns(s)
        mgr = ns.mgr
        before = (s.reserve_target, reserve_owed(s))
        restored = 0
        for key, slot in zip(keys, ns.slots.slots_at(offsets), strict=True):
            if slot is None or slot not in s.granted:
                continue
            s.granted.discard(slot)
            if s.kept.pop(slot, None) == key and mgr.restore(key, slot):
                restored += 1
            else:
                ns.slots.free(slot)
        ns.carry_reserve(s, *before)
        return restored

    def owes(self, s: Session) -> bool:
        """Whether the session's reserve is below its target."""
        return s.reserve_target > len(s.granted)

    def return_slots(self, s: Session, offsets: Sequence[int]) -> int:
        """Granted slots the session will not use (it never wrote them): free again (its
        target stays: a session lowers it first). How many were its own granted slots."""
        ns = self._ns(s)
        before = (s.reserve_target, reserve_owed(s))
        returned = 0
        for offset in offsets:
            slot = ns.slots.slot_at(offset)
            if slot is None or slot not in s.granted:
                continue
            s.granted.discard(slot)
            s.kept.pop(slot, None)
            ns.slots.free(slot)
            returned += 1
        ns.carry_reserve(s, *before)
        return returned

    def store_granted(self, s: Session, keys: Sequence[bytes], req_id: str,
                      positions: Sequence[int] | None, granted_keys: Sequence[bytes],
                      granted_offsets: Sequence[int]) -> StoreGrantedAnswer:
        """The session stored into its granted slots: see StoreGrantedRequest (kvd.proto)."""
        core = self.core
        ns = self._ns(s)
        mgr = ns.mgr
        epoch = mgr.epoch
        offered = set(keys)
        bound: list[tuple[bytes, int]] = []
        taken: set[int] = set()           # a slot named twice in one call holds one key
        refused = 0
        for key, slot in zip(granted_keys, ns.slots.slots_at(granted_offsets), strict=True):
            if slot is None or slot not in s.granted or slot in taken or key not in offered \
                    or (epoch, key) in s.pending:
                refused += 1
                continue
            taken.add(slot)
            bound.append((key, slot))
        if len(s.pending) + len(bound) > MAX_PENDING_STORES_PER_SESSION:
            return StoreGrantedAnswer(0, 0, len(bound) + refused, [], epoch)
        owed = ns.reserve_owed            # before these slots leave the reserve
        before = (s.reserve_target, reserve_owed(s))
        s.granted.difference_update(taken)
        if s.kept:
            for slot in taken:
                s.kept.pop(slot, None)
        ns.carry_reserve(s, *before)
        result = mgr.offer(keys, bound, core.request_key(s, req_id), positions or None, owed)
        # Duplicates too: they settle at completion.
        s.pending.update(((epoch, key), slot) for key, slot in bound)
        if s.hints:                       # the offered blocks readable already
            core.retention.touched(s, req_id, keys)
        return StoreGrantedAnswer(len(result.accepted), len(result.duplicates), refused,
                                  result.evicted, epoch)

    def pin_loads(self, s: Session, keys: Sequence[bytes], offsets: Sequence[int],
                  req_id: str, positions: Sequence[int] | None) -> tuple[int, int]:
        """Loads the session started from its own lookups: (pinned, epoch)."""
        core = self.core
        ns = self._ns(s)
        core.check_pin_room(s, len(keys))
        mgr = ns.mgr
        epoch = mgr.epoch
        slots = ns.slots.slots_at(offsets)
        if len(slots) != len(keys):
            raise ValueError(f"{len(offsets)} offsets for {len(keys)} keys")
        if None in slots:                # an offset that names no slot of the namespace
            usable = [(k, sl, i) for i, (k, sl) in enumerate(zip(keys, slots, strict=True))
                      if sl is not None]
            keys, slots = [k for k, _, _ in usable], [sl for _, sl, _ in usable]
            positions = [positions[i] for _, _, i in usable] if positions else None
        pinned = mgr.pin_loads(keys, slots, core.request_key(s, req_id), positions or None)
        pins = s.pins
        get = pins.get
        for key in pinned:
            pk = (epoch, key)
            pins[pk] = get(pk, 0) + 1
        if s.hints:
            core.retention.touched(s, req_id, pinned)
        if ns.mgr.retention.prewarmed:
            ns.mgr.retention.loaded(pinned)
        return len(pinned), epoch

    def count_lookups(self, s: Session, lookups: int, hits: int, misses: int) -> None:
        """What the session answered from the index itself, for the namespace's counters."""
        ns = self._ns(s)
        ns.lookups_total += lookups
        ns.hits_total += hits
        ns.misses_total += misses

    def promote(self, s: Session, keys: Sequence[bytes]) -> None:
        """Keys the engine answered HIT_PENDING from the held-below table (PROMOTE): start
        promoting those only the tier below holds (nothing without a tier)."""
        if self.below is not None:
            self.below.promote(self._ns(s), keys)

    def find(self, s: Session, keys: Sequence[bytes], done: Callable[[], None]) -> bool:
        """Keys the engine's lookups found neither in the index nor held below, in a
        namespace whose store is asked (FIND): `done` once the store answered and what it
        holds is named held below; False (done never called) without such a tier."""
        return self.below is not None and self.below.find(self._ns(s), keys, done)
