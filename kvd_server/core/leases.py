"""Lookup leases of the call protocol: a HIT held readable for a while, without a pin yet.

A client that looks keys up with `lease_ms` gets each HIT held under a lease (one ref on its
block, `NamespaceManager.lease`) until it loads it (PrepareLoad turns the lease into its load
pin), gives it back (CompleteLoad without a load) or the lease expires (the sweep, on 100 ms
ticks). A lease is per (session, key), renewed by a later lookup, and dies with its epoch at a
reset. The engines on the shared-index protocol need none: their published epoch keeps what
they found readable.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from kvd_server.core.sessions import MAX_LEASES_PER_SESSION, Session
from kvd_server.errors import ResourceExhausted
from kvd_server.manager import NamespaceManager


class ExpiryWheel:
    """Lease deadlines in 100 ms ticks: one entry per live lease, whatever the renewals.

    A renewal moves the lease to its new tick; a lease that ends early (loaded, released, its
    session gone) is taken out of its tick, so memory follows the leases held, not the calls
    made (a heap entry per renewal grew without bound under a client renewing in a loop).
    """

    TICK_S = 0.1

    def __init__(self) -> None:
        self._ticks: dict[int, set[tuple[str, bytes]]] = {}
        self._order: list[int] = []          # heap of the ticks in _ticks

    def _tick(self, expiry: float) -> int:
        return math.ceil(expiry / self.TICK_S)

    def add(self, token: str, key: bytes, expiry: float) -> None:
        tick = self._tick(expiry)
        entries = self._ticks.get(tick)
        if entries is None:
            entries = self._ticks[tick] = set()
            heapq.heappush(self._order, tick)
        entries.add((token, key))

    def discard(self, token: str, key: bytes, expiry: float) -> None:
        tick = self._tick(expiry)
        entries = self._ticks.get(tick)
        if entries is not None:
            entries.discard((token, key))
            if not entries:
                del self._ticks[tick]      # an emptied set keeps its table: drop it

    def move(self, token: str, key: bytes, old: float, new: float) -> None:
        if self._tick(old) != self._tick(new):
            self.discard(token, key, old)
            self.add(token, key, new)

    def due(self, now: float) -> list[tuple[str, bytes]]:
        """Take out every entry whose tick has passed."""
        out: list[tuple[str, bytes]] = []
        limit = self._tick(now)
        while self._order and self._order[0] <= limit:
            out.extend(self._ticks.pop(heapq.heappop(self._order), ()))
        if len(self._order) > 4 * len(self._ticks) + 64:   # ticks emptied and dropped early
            self._order = sorted(self._ticks)
        return out

    def __len__(self) -> int:
        return sum(len(e) for e in self._ticks.values())


class Leases:
    """Every session's leases and their deadlines (see the module doc)."""

    def __init__(self) -> None:
        self._timers = ExpiryWheel()
        self.expired_total = 0

    def grant(self, s: Session, mgr: NamespaceManager, key: bytes, expiry: float,
              epoch: int) -> int | None:
        """Lease a ready block to `s` until `expiry` (renewing its lease); its slot."""
        current = s.leases.get(key)
        if current is not None and current[1] == epoch:
            if expiry > current[0]:
                s.leases[key] = (expiry, epoch)
                self._timers.move(s.token, key, current[0], expiry)
        else:
            if len(s.leases) >= MAX_LEASES_PER_SESSION:
                raise ResourceExhausted(f"session holds {len(s.leases)} leases already; load "
                                        "or let them expire")
            if current is not None:  # a lease from an older epoch: release its zombie ref
                mgr.release_lease(key, current[1])
                self._timers.discard(s.token, key, current[0])
            if not mgr.lease(key):
                s.leases.pop(key, None)
                return None
            s.leases[key] = (expiry, epoch)
            self._timers.add(s.token, key, expiry)
        return mgr.slot_of(key)

    def take_back(self, s: Session, mgr: NamespaceManager, key: bytes, epoch: int) -> bool:
        """End `s`'s lease of `key` from `epoch` (loaded, or given back), releasing its ref;
        False when it holds none."""
        lease = s.leases.get(key)
        if lease is None or lease[1] != epoch:
            return False
        del s.leases[key]
        self._timers.discard(s.token, key, lease[0])
        mgr.release_lease(key, epoch)
        return True

    def drop(self, s: Session) -> None:
        """Forget a session's leases and their timers (their refs are the caller's)."""
        for key, (expiry, _) in s.leases.items():
            self._timers.discard(s.token, key, expiry)
        s.leases.clear()

    def release(self, s: Session, mgr: NamespaceManager) -> None:
        """Release every lease of `s` (a reset: they die with the epoch)."""
        for key, (_, epoch) in s.leases.items():
            mgr.release_lease(key, epoch)
        self.drop(s)

    def expire(self, now: float, session_of: Callable[[str], Session | None]) -> None:
        """Release the leases whose deadline passed (unless renewed meanwhile)."""
        for token, key in self._timers.due(now):
            s = session_of(token)
            if s is None:
                continue
            lease = s.leases.get(key)
            if lease is None:
                continue
            if lease[0] > now:     # renewed into a later tick meanwhile
                self._timers.add(token, key, lease[0])
                continue
            del s.leases[key]
            if s.ns is not None:
                s.ns.mgr.release_lease(key, lease[1])
                s.ns.release_extents()
            self.expired_total += 1
