"""The free slots a session holds granted for its future stores, sized from what it stores.

`prepare_store` must answer at once, so the slots come from a reserve the daemon granted in
advance. Too small a reserve declines stores (vLLM counts an allocation failure and offers the
same blocks again); too large a one keeps free slots out of the cache (what the pool holds is
blocks plus every engine's reserve). So the session tells the daemon a target and the daemon
keeps the reserve topped up, granting slots as they come free (after the evictions the
session's stores cause, once every reader has moved past the evicted slots). The target
follows demand, measured directly: the most keys one step asked slots for (over the last
DEMAND_WINDOW steps) plus the most the reserve was found short of its target at a step's start
(what is consumed while the refill is on its way), with HEADROOM; at least `floor`, and in a
session's first DEMAND_WINDOW steps at least its initial size, up to a sixteenth of the pool (a
young session has not seen its bursts yet). What demand
adds above the floor is capped at a quarter of the pool's slots (a small pool stays a cache;
an engine that asks for a larger floor gets it). Slots far above the target (demand fell and
stayed low for a window) go back.

A granted slot came free by an eviction and still holds the evicted block until it is
written: the daemon names those blocks (GRANTED, for a session that set RESERVE's flag 2;
docs/attach.md, "Kept blocks in granted slots"), and while such a slot is still here the
session may take it back as its block (`reclaim`; the session sends RESTORE) instead of
missing a block vLLM's own manager, which evicts only when a store needs the room, would hit.
Stores take the oldest-granted slots first (`slots` is taken from its end; grants go in at
its front): the order in which vLLM would have evicted their blocks.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from kvd_proto import records as rec
from kvd_proto.native import KeptTable, list_discard
from kvd_proto.wire import MAX_GRANTED_SLOTS

DEMAND_WINDOW = 64           # steps over which the peak demand and the largest deficit count
HEADROOM = 1.5
DEFAULT_FLOOR = 16           # the smallest reserve of an engine that stores nothing
DEFAULT_INITIAL = 768        # the least a session holds in its first DEMAND_WINDOW steps:
                             # an engine's first steps admit many requests at once while the
                             # daemon, behind on their records, refills a few steps late
                             # (measured through vLLM's scheduler at 128 sequences flat out:
                             # up to ~740 slots stored before the first refill; 256 answered
                             # up to 57 prepare_store calls None)
CAP_SHARE = 4                # demand takes the reserve to at most 1/CAP_SHARE of the pool
YOUNG_SHARE = 16             # a young session's floor is at most 1/YOUNG_SHARE of the pool


class _WindowMax:
    """The largest of the last DEMAND_WINDOW values (0 before any), kept as they come: the
    window is scanned again only when its largest value leaves it."""

    __slots__ = ("_values", "max", "seen")

    def __init__(self) -> None:
        self._values: deque[int] = deque(maxlen=DEMAND_WINDOW)
        self.max = 0
        self.seen = 0                        # values added, up to DEMAND_WINDOW

    def add(self, value: int) -> None:
        values = self._values
        leaving = values[0] if len(values) == DEMAND_WINDOW else -1
        values.append(value)
        if value >= self.max:
            self.max = value
        elif leaving == self.max:
            self.max = max(values)
        if self.seen < DEMAND_WINDOW:
            self.seen += 1


class StoreReserve:
    """Granted slot offsets and the target the daemon keeps them at (see the module doc)."""

    def __init__(self, floor: int = DEFAULT_FLOOR, initial: int = DEFAULT_INITIAL, *,
                 keep_evicted: bool = True) -> None:
        self.floor = max(1, min(floor, MAX_GRANTED_SLOTS))
        self.initial = max(self.floor, min(initial, MAX_GRANTED_SLOTS))
        self.cap = MAX_GRANTED_SLOTS              # see `size_for`
        self.young = self.initial                 # the least held in the first steps
        self.target = self.initial
        self.sent = -1                            # the target the daemon last heard
        self.slots: list[int] = []                # taken from the end (a slice), oldest
        # Evicted blocks granted slots still hold: key -> the slot's offset (the object in
        # `slots`) while the slot is there, or -(seq + 1) once taken back (RESTORE sent in
        # step `seq`, until the daemon has read it); an entry goes with its slot. The lookups
        # hand these keys to the session (kvd_proto/native.py KeptTable: compiled, no Python
        # object per key).
        self.kept = KeptTable()
        self.keep_evicted = keep_evicted          # ask the daemon to name them (flag 2)
        self._restoring: deque[tuple[int, bytes]] = deque()   # (seq, key) taken back, in order
        self._demand = _WindowMax()
        self._deficit = _WindowMax()
        self._step_demand = 0
        self._unreplaced = 0                      # slots taken since the daemon caught up
        self.declined = 0                         # stores it could not hold
        self.urgent = False         # declined since the target was last sent: evict now

    def __len__(self) -> int:
        return len(self.slots)

    def size_for(self, pool_slots: int) -> None:
        """The pool holds `pool_slots` slots of this engine's size: demand may take the
        reserve up to a quarter of them (never below the floor)."""
        self.cap = max(self.floor, min(MAX_GRANTED_SLOTS, pool_slots // CAP_SHARE))
        # The young session's floor costs cache for 64 steps: at most 1/YOUNG_SHARE of the
        # pool (768 of a 65,536-slot pool; 37 of a 600-slot one, where it cost 1.7% of hits).
        self.young = max(self.floor, min(self.initial, pool_slots // YOUNG_SHARE))
        self.target = min(self.target, self.cap)

    def take(self, n: int) -> list[int] | None:
        """`n` slots, or None (nothing taken) when fewer are held; the demand counts either
        way, so the target covers it from the next step on."""
        if n > len(self.slots):
            self._step_demand += n
            self.declined += 1
            self.urgent = True
            return None
        if not n:
            self.took([])
            return []
        taken = self.slots[-n:]
        del self.slots[-n:]
        self.took(taken)
        return taken

    def took(self, taken: list[int]) -> None:
        """`taken` slots left the end of `slots` (`take`, or the compiled store path of
        kvd_proto/_steps.c, which takes them itself): the evicted blocks they held are
        gone (stored over)."""
        n = len(taken)
        self._step_demand += n
        self._unreplaced += n
        if len(self.kept):
            self.kept.discard_offsets(taken)

    def reclaim(self, key: bytes, seq: int) -> int | None:
        """Take the slot still holding the evicted block `key` out of the reserve, to be that
        block again (the session sends RESTORE in step `seq`): its offset, or None when no
        slot here holds it."""
        kept = self.kept
        offset = kept.get(key)
        if offset is None or offset < 0:
            return None
        if not list_discard(self.slots, offset):   # not held (cannot be): forget it
            kept.pop(key)
            return None
        kept.put(key, -(seq + 1))
        self._restoring.append((seq, key))
        self._step_demand += 1                      # a slot left the reserve: replaced as one
        self._unreplaced += 1
        return offset

    def restored(self, acked: int) -> None:
        """The daemon has read every record up to step `acked`: the blocks taken back in
        those steps are in the index (or were refused): the lookups go there again."""
        restoring, kept = self._restoring, self.kept
        while restoring and restoring[0][0] <= acked:
            seq, key = restoring.popleft()
            if kept.get(key) == -(seq + 1):
                kept.pop(key)

    def begin_step(self) -> None:
        """The step starts (after the daemon's grants were applied): the slots taken and not
        replaced yet are what the last steps consumed before the refill came."""
        self._deficit.add(self._unreplaced)

    def end_step(self) -> None:
        """Close a step's demand into the window and size the target from it."""
        demand = self._demand
        demand.add(self._step_demand)
        self._step_demand = 0
        if demand.max == 0 and demand.seen < DEMAND_WINDOW:
            return                               # nothing seen yet: keep the initial size
        wanted = math.ceil(HEADROOM * (demand.max + self._deficit.max))
        if demand.seen < DEMAND_WINDOW:
            # A young session has seen too few steps to know its bursts (an engine's first
            # steps admit many requests at once): the initial size stays the least it holds.
            wanted = max(wanted, self.young)
        self.target = min(self.cap, max(self.floor, wanted))

    def to_send(self) -> tuple[int, bool] | None:
        """(target, evict) to tell the daemon now, or None when it knows the target already
        and nothing was declined."""
        if self.target == self.sent and not self.urgent:
            return None
        self.sent = self.target
        urgent, self.urgent = self.urgent, False
        return self.target, urgent

    def granted(self, offsets: list[int], kept_index: Sequence[int] = (),
                kept_keys: Sequence[bytes] = ()) -> None:
        """Slots the daemon granted (a top-up), at the front (taken last); `kept_index` and
        `kept_keys`: which of them still hold which evicted block."""
        self.slots[:0] = offsets
        self._unreplaced = max(0, self._unreplaced - len(offsets))
        for i, key in zip(kept_index, kept_keys, strict=True):
            self.kept.put(key, offsets[i])

    def granted_record(self, payload: bytes) -> bool:
        """A GRANTED record's payload applied as `granted` applies it decoded, in one pass
        (the KeptTable's `apply`, compiled where built: the top-up comes every step or two
        when the engine stores flat out); False, nothing changed, for a shape only the
        checked decoder reads (the caller decodes it and calls `granted`)."""
        count = self.kept.apply(payload, self.slots)
        if count is None:
            return False
        self._unreplaced = max(0, self._unreplaced - count)
        return True

    def surplus(self) -> list[int]:
        """Slots far above the target (demand fell): to give back to the daemon, after the
        lowered target (or the daemon would top them up again)."""
        if len(self.slots) <= 2 * self.target or self.sent != self.target:
            return []
        surplus = [self.slots.pop() for _ in range(len(self.slots) - self.target)]
        if len(self.kept):
            self.kept.discard_offsets(surplus)
        return surplus

    def step_records(self) -> list[bytes]:
        """Close the step (`end_step`); what to tell the daemon: the target when it changed
        (or a store was declined), then the slots given back."""
        self.end_step()
        out = []
        told = self.to_send()
        if told is not None:
            out.append(rec.encode_reserve(*told, kept=self.keep_evicted))
        surplus = self.surplus()
        for i in range(0, len(surplus), MAX_GRANTED_SLOTS):
            out.append(rec.encode_return_slots(surplus[i:i + MAX_GRANTED_SLOTS]))
        return out

    def clear(self) -> None:
        """A new session: no slot of the old one is ours any more, and it has heard nothing."""
        self.slots.clear()
        self.forget_kept()
        self._unreplaced = 0
        self.sent = -1
        self.urgent = False

    def forget_kept(self) -> None:
        """No slot's evicted block is to be taken back any more (a new session, a reset)."""
        self.kept.clear()
        self._restoring.clear()
