"""The free slots a session holds granted for its future stores, sized from what it stores.

`prepare_store` must answer at once, so the slots come from a reserve the daemon granted in
advance. Too small a reserve declines stores (vLLM counts an allocation failure and offers the
same blocks again); too large a one keeps free slots out of the cache (what the pool holds is
blocks plus every engine's reserve). So the target follows demand, measured directly: the
most keys asked for while a grant was on its way (over the last LAG_WINDOW grants) plus the
most keys one step asked for (over the last DEMAND_WINDOW steps), with HEADROOM; at least
`floor`; what demand adds above the floor is capped at a quarter of the pool's slots (a small
pool stays a cache; an engine that asks for a larger floor gets it). Grants
are asked for ahead at every step's end; slots far above the target (demand fell and stayed
low for a window) go back.
"""

from __future__ import annotations

import math
from collections import deque

from kvd_proto.wire import MAX_GRANTED_SLOTS

DEMAND_WINDOW = 64           # steps over which the peak demand is taken
LAG_WINDOW = 16              # grants over which the most asked for meanwhile is taken
HEADROOM = 1.5
DEFAULT_FLOOR = 16           # the smallest reserve of an engine that stores nothing
DEFAULT_INITIAL = 128        # before any demand is seen (the first steps of a new session)
CAP_SHARE = 4                # demand takes the reserve to at most 1/CAP_SHARE of the pool


class StoreReserve:
    """Granted slot offsets, the target and the grants asked for (see the module doc)."""

    def __init__(self, floor: int = DEFAULT_FLOOR, initial: int = DEFAULT_INITIAL) -> None:
        self.floor = max(1, min(floor, MAX_GRANTED_SLOTS))
        self.initial = max(self.floor, min(initial, MAX_GRANTED_SLOTS))
        self.cap = MAX_GRANTED_SLOTS              # see `size_for`
        self.target = self.initial
        self.slots: deque[int] = deque()
        self._asked: deque[tuple[int, int]] = deque()     # (count, demand then) in order
        self.asking = 0                                   # slots asked, not answered
        self._demand: deque[int] = deque(maxlen=DEMAND_WINDOW)
        self._during: deque[int] = deque([0], maxlen=LAG_WINDOW)   # asked while granting
        self._step_demand = 0
        self._total_demand = 0
        self.declined = 0                                 # stores it could not hold

    def __len__(self) -> int:
        return len(self.slots)

    def size_for(self, pool_slots: int) -> None:
        """The pool holds `pool_slots` slots of this engine's size: demand may take the
        reserve up to a quarter of them (never below the floor)."""
        self.cap = max(self.floor, min(MAX_GRANTED_SLOTS, pool_slots // CAP_SHARE))
        self.target = min(self.target, self.cap)

    def take(self, n: int) -> list[int] | None:
        """`n` slots, or None (nothing taken) when fewer are held; the demand counts either
        way, so the next grants cover it."""
        self._step_demand += n
        self._total_demand += n
        if n > len(self.slots):
            self.declined += 1
            # Ask at once for what this step showed it needs (the target follows at the
            # step's end); a later step's offer of the same keys will find it.
            self.target = min(self.cap, max(self.target, self._wanted(n)))
            return None
        slots = self.slots
        return [slots.popleft() for _ in range(n)]

    def _wanted(self, peak: int) -> int:
        return max(self.floor, math.ceil(HEADROOM * (peak + max(self._during))))

    def end_step(self) -> None:
        """Close a step's demand into the window and size the target from it."""
        self._demand.append(self._step_demand)
        self._step_demand = 0
        if len(self._demand) < DEMAND_WINDOW and max(self._demand) == 0:
            return                               # nothing seen yet: keep the initial size
        self.target = min(self.cap, self._wanted(max(self._demand)))

    def to_ask(self) -> int:
        """How many slots to ask for now (0: none)."""
        want = self.target - len(self.slots) - self.asking
        if want <= 0:
            return 0
        self.asking += want
        self._asked.append((want, self._total_demand))
        return want

    def granted(self, offsets: list[int]) -> None:
        """The answer to the oldest grant asked for (maybe fewer slots than asked)."""
        if self._asked:
            count, demand_then = self._asked.popleft()
            self.asking = max(0, self.asking - count)
            self._during.append(self._total_demand - demand_then)
        self.slots.extend(offsets)

    def lost_asks(self) -> None:
        """The daemon will not answer what was asked (its session ended)."""
        self._asked.clear()
        self.asking = 0

    def surplus(self) -> list[int]:
        """Slots far above the target (demand fell): to give back to the daemon."""
        extra = len(self.slots) - 2 * self.target
        if extra <= 0 or self.asking:
            return []
        return [self.slots.pop() for _ in range(len(self.slots) - self.target)]

    def clear(self) -> None:
        """A new session: no slot of the old one is ours any more."""
        self.slots.clear()
        self.lost_asks()
