"""One namespace's offload index: vLLM 0.33 CPUOffloadingManager semantics plus what a shared
daemon needs (lookup leases, epochs, zombies).

Block states: storing (invisible to lookups as HIT) -> ready (unpinned, evictable) -> pinned
(held by a load's pin or a lookup's lease: one ref each); kept per slot in a `BlockTable`,
keys in the shared index. Eviction
is all-or-nothing and never touches storing, pinned or offered blocks. `reset()` drops every
block at once; a block still being copied (pinned or storing) keeps its slot as a zombie of
the old epoch (manager/zombies.py) until the copy's completion with that epoch arrives, so no
new store can overwrite memory an engine still reads or writes. What each open request did
is recorded apart (manager/requests.py), so are the events (manager/events.py).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvd_proto.wire import DEFAULT_INDEX_KEY_BYTES
from kvd_server.errors import NotReady
from kvd_server.memory.shm_index import ShmIndex
from kvd_server.policy_names import LRU

from .blocks import ABSENT, READY, STORING, BlockTable
from .events import EventQueue
from .policies import RequestState, make_policy
from .requests import RecencyBudget, RequestLog
from .retaining import Retaining
from .retention import RetainedBlocks
from .types import (
    NO_BELOW,
    BelowPort,
    BlockCounts,
    Lookup,
    OfferResult,
    OffloadEvent,
    SlotSource,
    StoreGrant,
)
from .zombies import Zombies


@dataclass(slots=True)
class ManagerCounters:
    """A namespace's block counters, each shown in its row of the stats (ops/snapshot.py):
    a counter kept here and shown nowhere would cost the hot path for no reader."""

    evictions_total: int = 0
    blocks_restored_total: int = 0        # evicted blocks a session took back (restore)
    stores_started_total: int = 0
    stores_completed_total: int = 0
    stores_failed_total: int = 0
    store_rejections_total: int = 0
    events_dropped_total: int = 0


class NamespaceManager(Retaining):
    """The index key -> block of one namespace over a `SlotSource`. Pure logic, no I/O.
    Agent sessions' retention is its `Retaining` part (manager/retaining.py)."""

    def __init__(self, slots: SlotSource, policy: str = LRU, *, enable_events: bool = True,
                 budget: RecencyBudget | None = None, index: ShmIndex | None = None,
                 policy_memory: Any = None) -> None:
        """`policy_memory`: where the policy keeps its per-slot order when it must outlive
        the daemon (warm restart; see make_policy)."""
        self.slots = slots
        if index is None:   # no engine reads it (tests, benchmarks): a private one
            cap = max(1, slots.capacity())
            index = ShmIndex(cap, DEFAULT_INDEX_KEY_BYTES, cap, 1, cap, private=True)
        # The shared index engines read is the only key store: every change of what is
        # stored where is published there as it happens.
        self.index = index
        self.table = BlockTable(index, index.header.capacity)
        self.policy = make_policy(policy, slots.capacity(), self.table, policy_memory)
        self.epoch = 0
        self.counters = ManagerCounters()
        self._events = EventQueue(enabled=enable_events)
        self._storing = 0
        self._evictable = 0
        self._zombies = Zombies()
        self.requests = RequestLog(self.policy, budget)
        # Blocks agent sessions' hints keep (manager/retention.py): one ref each. With warm
        # restart their words follow the policy's order in the memory that outlives the
        # daemon (one int64 per slot each; `retention_memory_bytes`).
        self.retention = RetainedBlocks()
        cap = self.table.capacity
        if policy_memory is not None and len(memoryview(policy_memory)) >= 16 * cap:
            self.retention.bind(np.frombuffer(policy_memory, dtype=np.int64, count=cap,
                                              offset=8 * cap))
        # The tiers under the pool (a BelowPort): evicted blocks go down before their slots
        # are freed (their removed events wait until no tier holds them: `lost_below`),
        # stored blocks are told, a reset drops what is held below; NO_BELOW without a tier.
        self.below: BelowPort = NO_BELOW

    def attach_below(self, below: BelowPort) -> None:
        """The tier's port, set once when a tier joins the namespace (kvd_server/tiers/
        demotion.py): the tier link joins namespaces the table has made already, so the port
        cannot be handed to the constructor."""
        self.below = below

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.table)

    def lookup(self, key: bytes) -> Lookup:
        slot = self.table.find(key)
        if slot < 0:
            return Lookup.MISS
        return Lookup.HIT_PENDING if self.table.state[slot] == STORING else Lookup.HIT

    def slot_of(self, key: bytes) -> int | None:
        slot = self.table.find(key)
        return None if slot < 0 else slot

    def counts(self) -> BlockCounts:
        resident = len(self.table)
        retained = len(self.retention)
        return BlockCounts(
            storing=self._storing,
            ready=self._evictable,
            pinned=max(0, resident - self._storing - self._evictable - retained),
            zombie=len(self._zombies),
            retained=retained,
        )

    def adopt(self, ready: np.ndarray) -> None:
        """Warm restart: the READY blocks the index shows in `ready` (checked, least recently
        used first) are this manager's, readable and evictable, in the index's reset epoch."""
        self.epoch = self.index.reset_epoch
        self.table.adopt(ready)
        self._evictable += len(ready)
        self.policy.adopt(ready)
        blocks, retention = self.table.state, self.retention
        for slot, tag, until in retention.persisted(ready):   # retained, hint running on
            retention.add(slot, tag, until)
            blocks[slot] += 1
            self._evictable -= 1
            self.policy.hold(slot)

    def is_empty(self) -> bool:
        return not len(self.table) and not self._zombies

    # --------------------------------------------------------- request scope
    def request_finished(self, req: Hashable) -> None:
        """Apply the request's recorded accesses to the policy in prefix order."""
        self.requests.finished(req)

    def forget_request(self, req: Hashable) -> None:
        """Drop a request's accesses without applying them (its session died)."""
        self.requests.drop(req)

    # ------------------------------------------------------------------ loads
    def prepare_load(self, keys: Sequence[bytes], req: Hashable | None = None,
                     positions: Sequence[int] | None = None) -> list[int]:
        """Pin ready blocks until complete_load; their slots in key order. All or nothing."""
        find, blocks = self.table.find, self.table.state
        slots = []
        for i, key in enumerate(keys):
            slot = find(key)
            if slot < 0 or blocks[slot] == STORING:
                raise NotReady(key, i)
            slots.append(slot)
        self._load(keys, slots, req, positions)
        return slots

    def _load(self, keys: Sequence[bytes], slots: Sequence[int], req: Hashable | None,
              positions: Sequence[int] | None) -> None:
        """Pin readable blocks found in `slots`, and record the request's access to them."""
        state = self.requests.opened(req, keys, positions)
        blocks = self.table.state
        for slot in slots:                          # a pin: one ref each
            if blocks[slot] == READY:
                self._evictable -= 1
            blocks[slot] += 1
        self.requests.record(keys, state, reused=keys,
                             slot_of=dict(zip(keys, slots, strict=True)))

    def lease(self, key: bytes) -> bool:
        """A lookup's lease (kvd_server/core/leases.py): one more ref on a readable block,
        without recency effects (a lease is no access); False when it is not readable."""
        slot = self.table.find(key)
        blocks = self.table.state
        if slot < 0 or blocks[slot] == STORING:
            return False
        if blocks[slot] == READY:
            self._evictable -= 1      # the policy sees it is no longer READY
        blocks[slot] += 1
        return True

    def complete_load(self, keys: Sequence[bytes], req: Hashable | None = None,
                      epoch: int | None = None) -> None:
        """Release one pin per key (keys without a pin are ignored)."""
        if epoch is not None and epoch != self.epoch:
            if epoch < self.epoch:       # copies of blocks a reset dropped
                for slot in self._zombies.completed(epoch, keys, loading=True):
                    self.slots.free(slot)
            return
        find, blocks = self.table.find, self.table.state
        unpinned: list[int] = []
        for key in keys:
            slot = find(key)
            if slot >= 0 and blocks[slot] > READY:
                blocks[slot] -= 1
                if blocks[slot] == READY:
                    unpinned.append(slot)
        if unpinned:
            self._evictable += len(unpinned)
            self.policy.mark_evictable_many(unpinned)

    def release_lease(self, key: bytes, epoch: int | None = None) -> None:
        """Release a lease taken with lease() in `epoch` (its ref, as a load's completion
        releases its pin)."""
        self.complete_load((key,), None, epoch)

    def _free_or_hold(self, slot: int, hold: list[int] | None) -> None:
        if hold is None:
            self.slots.free(slot)
        else:
            hold.append(slot)  # the caller frees it later (quarantine)

    def touch(self, keys: Sequence[bytes], req: Hashable | None = None) -> None:
        self.policy.touch(keys, self.requests.get(req))

    # ----------------------------------------------------------------- stores
    def _classify_offer(self, keys: Sequence[bytes], req: Hashable | None,
                        positions: Sequence[int] | None) -> tuple[RequestState, list[bytes]]:
        """vLLM's prepare_store bookkeeping of an offer: positions, ghost hits, request
        accesses; returns the request and the offered keys that are new."""
        state = self.requests.opened(req, keys, positions)
        new, ready, slot_of = self.table.classify(keys)
        self.requests.offered(state, keys, new, ready, slot_of)
        return state, new

    def _shortfall(self, n: int, owed: int, at_once: bool) -> int:
        """Slots missing for `n` more blocks and `owed` slots of sessions' reserves.

        Slots freed but waiting for readers (limbo) count as free unless the caller needs
        the room `at_once` (it allocates now); either way free and limbo are read together
        after one collection, so what is evicted does not depend on when freed slots happen
        to come back (an engine in another process may publish its mark at any moment)."""
        free = self.slots.free_count()          # collects first
        limbo = self.slots.in_limbo()
        if at_once:
            return n - free + max(0, owed - limbo)
        return n + owed - free - limbo

    def make_room(self, n: int, protected: Sequence[bytes] = (), owed: int = 0, *,
                  at_once: bool = False) -> list[bytes] | None:
        """Make room for `n` more blocks and `owed` reserved slots (see `_shortfall`):
        another namespace's extents first, then this one's policy; the evicted keys, or None
        when there is no room (nothing changed)."""
        need = self._shortfall(n, owed, at_once)
        if need > 0 and self.slots.reclaim(need):
            need = self._shortfall(n, owed, at_once)   # extents taken from others
        if need <= 0:
            return []
        if need > self._evictable and not self._give_way(need - self._evictable):
            return None
        victims = self.policy.evict(need, set(protected))
        if victims is None:
            return None
        self._evictable -= len(victims)
        kept = self.below.demote(victims)
        if self.retention.tag_of:
            self.retention.evicted(victims, kept)
        evicted = [key for key, _ in victims]
        slots = [slot for _, slot in victims]
        self.table.drop_many(slots)
        # The victims' bytes stay in their slots until a writer is given them: a session
        # granted one may take it back as its block (`restore`).
        self.slots.free_many(slots, evicted)
        self.counters.evictions_total += len(victims)
        self._emit_removed(evicted, kept)
        return evicted

    def _emit_removed(self, keys: Sequence[bytes], kept: Collection[bytes]) -> None:
        gone = tuple(k for k in keys if k not in kept) if kept else tuple(keys)
        if gone:
            self._emit(OffloadEvent(gone, removed=True))

    def lost_below(self, keys: Sequence[bytes]) -> None:
        """Blocks a tier below held are gone from it (evicted there, corrupt, a failed
        write): removed events for those the pool does not hold either."""
        find = self.table.find
        gone = tuple(k for k in keys if find(k) < 0)
        if gone:
            self._emit(OffloadEvent(gone, removed=True))

    def _start_stores(self, keys: Sequence[bytes], slots: Sequence[int],
                      state: RequestState) -> None:
        """Publish each new block of `keys` as being stored in its slot."""
        self.table.add_many(keys, slots)
        self.policy.insert_many(keys, slots, state)
        self._storing += len(keys)
        self.counters.stores_started_total += len(keys)
        state.inserted.update(k for k in keys if k in state.seen)

    def prepare_store(self, keys: Sequence[bytes], req: Hashable | None = None,
                      positions: Sequence[int] | None = None, owed: int = 0
                      ) -> StoreGrant | None:
        """Reserve slots for the offered keys that are new; None when there is no room.
        `owed`: slots the namespace owes its sessions' reserves (kept free for them)."""
        state, new = self._classify_offer(keys, req, positions)
        if not new:
            return StoreGrant([], [], [])
        evicted = self.make_room(len(new), keys, owed, at_once=True)
        if evicted is None or self.slots.free_count() < len(new):
            # (What was evicted waits for readers: no room *now*; events went out already.)
            self.counters.store_rejections_total += 1
            return None
        slots = self.slots.allocate(len(new))
        self._start_stores(new, slots, state)
        return StoreGrant(new, slots, evicted)

    def offer(self, keys: Sequence[bytes], granted: Sequence[tuple[bytes, int]],
              req: Hashable | None = None, positions: Sequence[int] | None = None,
              owed: int = 0) -> OfferResult:
        """A store an engine decided itself into slots it was granted (StoreGranted):
        prepare_store's bookkeeping of `keys`, the eviction prepare_store would have done
        (the session's next grants find that room), then each granted (key, slot) published
        as being stored. A granted key that is not new is a duplicate: its slot stays the
        engine's, and settles when the engine completes it (complete_store with `slots`)."""
        state, new = self._classify_offer(keys, req, positions)
        fresh = set(new)
        bound = [(k, slot) for k, slot in granted if k in fresh]
        duplicates = [(k, slot) for k, slot in granted if k not in fresh]
        # The granted slots are in use already (the session's reserve): what vLLM would free
        # for these stores is what the reserve needs back.
        evicted = self.make_room(len(bound), keys, owed) or []
        stored = [k for k, _ in bound]
        self._start_stores(stored, [slot for _, slot in bound], state)
        return OfferResult(stored, [k for k, _ in duplicates], evicted)

    def complete_store(self, keys: Sequence[bytes], success: bool = True,
                       req: Hashable | None = None, epoch: int | None = None,
                       hold: list[int] | None = None,
                       slots: Sequence[int] | None = None) -> int:
        """Make pending blocks readable (success) or free them; returns how many changed.

        With `slots` (one per key: where the completing store wrote), a store into another
        slot than the key's block is a duplicate: the first such store to complete wins (the
        block moves to its slot), a later one's slot is freed. With `hold`, the slots of
        failed stores are appended to it instead of being freed: the caller quarantines them
        while the writer might still be copying into them.
        """
        if epoch is not None and epoch != self.epoch:
            if epoch < self.epoch:       # stores into blocks a reset dropped
                for slot in self._zombies.completed(epoch, keys, loading=False, slots=slots,
                                                    table=self.table):
                    self._free_or_hold(slot, hold)
            return 0
        changed: list[bytes] = []
        ready_slots: list[int] = []
        table, blocks = self.table, self.table.state
        for i, key in enumerate(keys):
            slot = table.find(key)
            if slots is not None and slot != slots[i]:
                if success and slot >= 0 and blocks[slot] == STORING:
                    self._move(key, slot, slots[i])      # the first completed copy wins
                    slot = slots[i]
                else:
                    self._free_or_hold(slots[i], hold)   # a later one loses its slot
                    continue
            if slot < 0 or blocks[slot] != STORING:
                continue
            self._storing -= 1
            if success:
                table.set_ready(slot)
                ready_slots.append(slot)
            else:
                self.policy.remove(slot)
                table.drop(slot)
                self._free_or_hold(slot, hold)
            changed.append(key)
        if changed:
            if success:
                self._evictable += len(ready_slots)
                self.policy.mark_evictable_many(ready_slots)
                self.counters.stores_completed_total += len(changed)
                self._emit(OffloadEvent(tuple(changed), removed=False))
                self.below.stored(changed, ready_slots)
                if self.retention.arriving:
                    self._arrived(changed)
            else:
                self.counters.stores_failed_total += len(changed)
                self._emit(OffloadEvent(tuple(changed), removed=True, metadata_only=True))
        return len(changed)

    def restore(self, key: bytes, slot: int) -> bool:
        """An engine takes a slot granted to it back as the block evicted from it (`key`), its
        bytes untouched since (NamespaceSlots.kept): READY there again, as recent as a block
        just used (where vLLM, which had not evicted it yet, answers it a hit). False when the
        key was stored again elsewhere meanwhile (the caller frees the slot)."""
        table = self.table
        if table.find(key) >= 0:
            return False
        table.add_many((key,), (slot,))
        self.policy.insert_many((key,), (slot,), self.requests.get(None))
        table.set_ready(slot)
        self._evictable += 1
        self.policy.mark_evictable_many((slot,))
        self.counters.blocks_restored_total += 1
        self._emit(OffloadEvent((key,), removed=False))
        return True

    def _move(self, key: bytes, old: int, slot: int) -> None:
        """A duplicate store completed first: the block takes its slot. The old slot stays in
        use until its own (losing) store completes."""
        self.table.move(key, old, slot)
        self.policy.moved(old, slot)

    def pin_loads(self, keys: Sequence[bytes], slots: Sequence[int],
                  req: Hashable | None = None,
                  positions: Sequence[int] | None = None) -> list[bytes]:
        """Loads an engine started from its own lookups: pin each key whose readable block
        still sits in the slot it read (prepare_load's bookkeeping for those); skip the rest."""
        find, blocks = self.table.find, self.table.state
        keep = [i for i, (key, slot) in enumerate(zip(keys, slots, strict=True))
                if find(key) == slot and blocks[slot] != STORING]
        if len(keep) == len(keys):
            pinned, pinned_slots, kept = list(keys), list(slots), positions
        else:
            pinned = [keys[i] for i in keep]
            pinned_slots = [slots[i] for i in keep]
            kept = [positions[i] for i in keep] if positions else None
        if pinned:
            self._load(pinned, pinned_slots, req, kept or None)
        return pinned

    def resident_slots(self, slots: Iterable[int]) -> list[int]:
        """Which of `slots` hold a block of this namespace's index (not zombies or held)."""
        blocks = self.table.state
        return [slot for slot in slots if blocks[slot] != ABSENT]

    def evict_slots(self, slots: Sequence[int]) -> bool:
        """Evict the blocks in exactly these slots, if every one is ready and unpinned (a
        whole extent taken by another namespace); change nothing otherwise."""
        blocks = self.table.state
        if any(blocks[slot] != READY for slot in slots):
            return False
        if not slots:
            return True
        keys = tuple(self.table.key_of(slot) for slot in slots)
        kept = self.below.demote(list(zip(keys, slots, strict=True)))
        if self.retention.tag_of:
            self.retention.evicted(zip(keys, slots, strict=True), kept)
        for slot in slots:
            self.policy.remove(slot)
            self.table.drop(slot)
            self.slots.free(slot)
        self._evictable -= len(slots)
        self.counters.evictions_total += len(slots)
        self._emit_removed(keys, kept)
        return True

    # ----------------------------------------------------------------- events
    def _emit(self, event: OffloadEvent) -> None:
        self._events.emit(event)
        self.counters.events_dropped_total = self._events.dropped_total

    def pending_events(self) -> int:
        return len(self._events)

    def take_events(self, max_events: int | None = None,
                    max_bytes: int | None = None) -> tuple[list[OffloadEvent], bool]:
        """Drain stored/removed events in order, at most `max_events` and about `max_bytes`
        of keys (always at least one event); `more` says whether any are left."""
        find = self.table.find
        return self._events.take(lambda key: find(key) < 0, max_events, max_bytes)

    # ------------------------------------------------------------------ reset
    def reset(self) -> int:
        """Drop every block; blocks still being copied become zombies. Returns blocks dropped
        from the pool (`reset_below` also says how many the tiers below dropped)."""
        return self.reset_below()[0]

    def reset_below(self) -> tuple[int, int]:
        """`reset`, and the blocks the tiers below the pool dropped with the namespace's:
        (pool, below)."""
        table = self.table
        dropped = len(table)
        below = self.below.reset()      # a reset drops what the tiers hold too
        blocks = table.state
        for slot in self.retention.clear():    # retention's refs are no copy in flight
            blocks[slot] -= 1
        freed = self._zombies.take_over(self.epoch, table)
        self.policy.clear()
        table.clear()
        self.slots.forget_kept()        # evicted before the reset: never readable again
        # Without zombies the slots go back to vLLM's fresh allocation order.
        if self._zombies or not self.slots.reset():
            for slot in freed:
                self.slots.free(slot)
        self._storing = 0
        self._evictable = 0
        self.requests.new_generation()
        self.epoch += 1
        self.index.reset_epoch = self.epoch
        return dropped, below
