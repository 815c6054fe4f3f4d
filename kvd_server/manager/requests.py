"""What each open request did to a namespace's cache, kept until it finishes.

vLLM 0.33's manager orders its eviction by request: a request's accesses (the keys it looked
up, loaded, offered, inserted; their token positions) are recorded as it runs and applied to
the policy in prefix order when it finishes. `RequestLog` keeps those records, one
`RequestState` per open request, within bounds (per request, per namespace, and the daemon's
`RecencyBudget` over every namespace): past them, accesses are not recorded (eviction order
degrades, memory does not grow). A reset starts a new generation: records of an older one
are dropped.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from .policies import RequestState
from .policies.base import Policy, group_of

MAX_OPEN_REQUESTS = 100_000
MAX_KEYS_PER_REQUEST = 65_536   # a request longer than this records no further recency
MAX_TRACKED_KEYS = 1 << 20      # keys recorded over all open requests of one namespace


class RecencyBudget:
    """How many keys open requests may record, shared by every namespace of a daemon.

    A request's recorded accesses (keys, positions, what it inserted or reused) live until it
    finishes; a client that never finishes its requests, or offers endless keys under one,
    would otherwise grow the daemon without bound. Past the budget, accesses are not
    recorded: eviction order degrades, memory does not grow.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> int:
        granted = max(0, min(n, self.limit - self.used))
        self.used += granted
        return granted

    def give(self, n: int) -> None:
        self.used -= n


class RequestLog:
    """Open requests' recorded accesses (see the module doc); `policy` hears them."""

    def __init__(self, policy: Policy, budget: RecencyBudget | None) -> None:
        self.policy = policy
        self._requests: dict[Hashable, RequestState] = {}
        policy.open_requests = self._requests.values()
        self._tracked = 0                     # keys recorded by the open requests
        self._budget = budget
        self.generation = 0

    def get(self, req: Hashable | None) -> RequestState:
        """The request's state (a throwaway one for no request), opened on first use."""
        if req is None:
            return RequestState(self.generation)
        state = self._requests.get(req)
        if state is None or state.generation != self.generation or state.finished:
            if state is not None:
                self.drop(req)
            if len(self._requests) >= MAX_OPEN_REQUESTS:
                # Oldest open request: its accesses are dropped, not applied.
                self.drop(next(iter(self._requests)))
            state = RequestState(self.generation)
            self._requests[req] = state
        return state

    def drop(self, req: Hashable) -> RequestState | None:
        """Forget an open request and give what it recorded back to the budgets."""
        state = self._requests.pop(req, None)
        if state is not None:
            self._release(len(state.seen) + len(state.positions))
        return state

    def _room(self, state_keys: int, wanted: int) -> int:
        """How many of `wanted` new entries a request holding `state_keys` may record."""
        room = min(wanted, MAX_KEYS_PER_REQUEST - state_keys, MAX_TRACKED_KEYS - self._tracked)
        if room > 0 and self._budget is not None:
            room = self._budget.take(room)
        room = max(room, 0)
        self._tracked += room
        return room

    def _release(self, n: int) -> None:
        self._tracked -= n
        if self._budget is not None:
            self._budget.give(n)

    def opened(self, req: Hashable | None, keys: Sequence[bytes],
               positions: Sequence[int] | None) -> RequestState:
        """The request's state, with the token positions of `keys` an access tells."""
        state = self.get(req)
        self.set_positions(state, keys, positions)
        return state

    def set_positions(self, state: RequestState, keys: Sequence[bytes],
                      positions: Sequence[int] | None) -> None:
        if not positions:
            return
        if len(positions) != len(keys):
            raise ValueError(f"{len(positions)} positions for {len(keys)} keys")
        known = state.positions
        pairs = dict(zip(keys, positions, strict=True))
        fresh = [k for k in pairs if k not in known]
        allowed = self._room(len(known), len(fresh))
        for key in fresh[allowed:]:
            del pairs[key]
        known.update(pairs)

    def record(self, keys: Sequence[bytes], state: RequestState,
               reused: Sequence[bytes] = (), slot_of: dict[bytes, int] | None = None) -> None:
        """A request's accesses; `slot_of` (key -> slot, -1 when not resident), when the
        caller found them already, spares the policy looking them up again."""
        seen = state.seen
        fresh = [k for k in dict.fromkeys(keys) if k not in seen]
        fresh = fresh[:self._room(len(seen), len(fresh))]
        if fresh:
            groups = state.key_groups
            if len(fresh[0]) >= 4 and len({k[-4:] for k in fresh}) == 1:
                groups.setdefault(group_of(fresh[0]), []).extend(fresh)  # one group: usual
            else:
                for key in fresh:
                    groups.setdefault(group_of(key), []).append(key)
        seen.update(fresh)
        if fresh:
            slots = None if slot_of is None else [slot_of[k] for k in fresh]
            self.policy.on_request_access(fresh, state, slots)
        # Re-reading a block this request inserted is not a second use.
        if reused:
            again = seen.intersection(reused)
            if again:
                again -= state.inserted
                state.reused |= again

    def offered(self, state: RequestState, keys: Sequence[bytes], new: Sequence[bytes],
                ready: Sequence[bytes], slot_of: dict[bytes, int]) -> None:
        """vLLM's prepare_store bookkeeping of an offer of `keys`: the `new` ones are store
        misses for the policy (once per request); they and the `ready` ones already stored
        are the request's accesses, in offer order."""
        misses = [k for k in new if k not in state.store_misses]
        if misses:
            self.policy.on_store_miss(misses, state)
            if len(state.store_misses) < MAX_KEYS_PER_REQUEST:
                state.store_misses.update(misses)
        recorded = set(new)
        recorded.update(ready)
        self.record([k for k in keys if k in recorded], state, reused=ready, slot_of=slot_of)

    def finished(self, req: Hashable) -> None:
        """Apply the request's recorded accesses to the policy in prefix order."""
        state = self.drop(req)
        if state is None or state.generation != self.generation or state.finished:
            return
        state.finished = True
        groups = []
        key_groups, positions = state.key_groups, state.positions
        known = positions.__contains__
        for group in sorted(key_groups):
            keys = key_groups[group]
            if all(map(known, keys)):
                keys = sorted(keys, key=positions.__getitem__)
            groups.append(tuple(keys))
        self.policy.on_request_finished(tuple(groups), state.inserted - state.reused,
                                        state.reused, state)

    def new_generation(self) -> None:
        """A reset: every open request's records are dropped."""
        for req in list(self._requests):
            self.drop(req)
        self.generation += 1
