"""The loads an engine has in flight, and the oldest reclaim epoch they make it publish.

A load copies out of slots the engine found READY in the shared index during one step; the
daemon reuses a freed slot only after every reader's published epoch has passed it, so the
session must keep publishing at most the epoch of the step each load started in until that
load finishes (docs/attach.md, "Reclamation"). `LoadTracker` remembers, per key, the load(s)
in flight as (reclaim epoch, reset epoch, request) and counts loads per reclaim epoch, so the
floor to publish is one min() over a handful of epochs.

One tuple is shared by every key of one pin and a pin is remembered whole, so that pinning and
finishing the common load (the keys it started, in any order, even where other requests load
the same keys) costs no per-key Python beyond one dict update.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

MAX_PIN_BATCHES = 1024         # pins remembered whole, for unpin's fast path (~ loads in flight)

Load = tuple[int, int, str]                 # a load in flight: (reclaim, reset, req_id)
_Held = Load | list[Load]


def _held(value: _Held) -> list[Load]:
    """A key's loads in flight, as a list."""
    return [value] if type(value) is tuple else value


class LoadTracker:
    """Loads in flight (see the module doc)."""

    def __init__(self) -> None:
        # key -> its load in flight, or a list of them while several requests load it
        self._loads: dict[bytes, _Held] = {}
        # (request, keys) of each pin in flight -> its epochs tuple: a cache, `_loads` stays
        # the truth, and an entry dropped at the bound only costs the slower path.
        self._pin_batches: dict[tuple[str, frozenset[bytes]], Load] = {}
        self._epochs: collections.Counter[int] = collections.Counter()
        # epochs of loads that were in flight at a reset: they still copy (the engine finishes
        # them) and stay protected until reset_flushed
        self._stale_epochs: collections.Counter[int] = collections.Counter()
        self._stale_loads: dict[int, list[bytes]] = {}

    def __len__(self) -> int:
        """Loads in flight (a key several requests load counts each)."""
        return sum(len(_held(v)) for v in self._loads.values())

    @property
    def holding(self) -> bool:
        """Whether any load (current or from before a reset) still holds back reuse."""
        return bool(self._epochs or self._stale_epochs)

    def floor(self, step_epoch: int) -> int:
        """The epoch to publish at a step whose index reads `step_epoch`."""
        if not self._epochs and not self._stale_epochs:
            return step_epoch
        return min(step_epoch, *self._epochs, *self._stale_epochs)

    def pin(self, loaded: list[bytes], epochs: Load) -> None:
        """Loads of `loaded` started under `epochs`."""
        loads = self._loads
        fresh = dict.fromkeys(loaded, epochs)
        if len(fresh) == len(loaded) and loads.keys().isdisjoint(fresh):
            loads.update(fresh)                 # the common case: no key loading already
        else:
            for key in loaded:
                held = loads.get(key)
                if held is None:
                    loads[key] = epochs
                elif type(held) is tuple:
                    loads[key] = [held, epochs]
                else:
                    held.append(epochs)
        self._epochs[epochs[0]] += len(loaded)
        batches = self._pin_batches
        if len(batches) >= MAX_PIN_BATCHES:
            del batches[next(iter(batches))]
        batches[(epochs[2], frozenset(loaded))] = epochs

    def unpin(self, keys: Sequence[bytes], req_id: str) -> tuple[dict[int, list[bytes]], int]:
        """Loads of `keys` finished: (keys per reset epoch, to complete at the daemon; keys
        that were not loading, e.g. loads of an earlier session)."""
        loads = self._loads
        held = list(map(loads.get, keys))
        first = held[0] if held else None
        released: dict[int, int]
        by_reset: dict[int, list[bytes]]
        batch = self._pin_batches.pop((req_id, frozenset(keys)), None) if keys else None
        unknown = 0
        if batch is not None and self._release_batch(keys, held, batch):
            released = {batch[0]: len(held)}
            by_reset = {batch[1]: list(keys)}
        elif type(first) is tuple and first[2] == req_id and held.count(first) == len(held) \
                and len(set(keys)) == len(held):
            # The common case: one load of each key in flight, all pinned by this request.
            collections.deque(map(loads.pop, keys), maxlen=0)
            released = {first[0]: len(held)}
            by_reset = {first[1]: list(keys)}
        else:
            released, by_reset, unknown = self._unpin_each(keys, req_id)
        epochs = self._epochs
        for reclaim, n in released.items():
            epochs[reclaim] -= n
            if epochs[reclaim] <= 0:
                del epochs[reclaim]
        return by_reset, unknown

    def _release_batch(self, keys: Sequence[bytes], held: list[_Held | None],
                       epochs: Load) -> bool:
        """End the load `epochs` of every key in `keys` (one pin, started together), shared
        with other requests' loads or not; False (nothing changed) unless each key holds it."""
        if len(set(keys)) != len(keys):
            return False
        if held.count(epochs) == len(held):           # nobody else loads these keys
            collections.deque(map(self._loads.pop, keys), maxlen=0)
            return True
        for h in held:
            if h is None or (h != epochs and (type(h) is tuple or epochs not in h)):
                return False
        loads = self._loads
        for key, h in zip(keys, held, strict=True):
            if type(h) is tuple:
                del loads[key]
            else:
                h.remove(epochs)                    # an equal tuple is the same load
                if len(h) == 1:
                    loads[key] = h[0]
        return True

    def _unpin_each(self, keys: Sequence[bytes], req_id: str
                    ) -> tuple[dict[int, int], dict[int, list[bytes]], int]:
        """unpin, key by key: (loads released per reclaim epoch, keys per reset epoch, keys
        not loading).

        A key several requests load ends the load of `req_id`; failing that (an engine that
        names no requests) the newest, so the loads left hold the older epochs: a floor too
        low holds freed slots back a little longer, one too high could hand a slot still
        being read to a new store."""
        by_reset: dict[int, list[bytes]] = {}
        released: dict[int, int] = {}
        loads = self._loads
        last: Load | None = None        # keys pinned together share one tuple: count runs
        group: list[bytes] = []
        run = 0
        unknown = 0
        for key in keys:
            held = loads.get(key)
            if held is None:
                unknown += 1
                continue
            if type(held) is tuple:
                epochs = held
                del loads[key]
            else:
                epochs = next((e for e in held if e[2] == req_id), None) or max(held)
                held.remove(epochs)
                if len(held) == 1:
                    loads[key] = held[0]
            if epochs is not last:
                if last is not None:
                    released[last[0]] = released.get(last[0], 0) + run
                last, run = epochs, 0
                group = by_reset.setdefault(epochs[1], [])
            run += 1
            group.append(key)
        if last is not None:
            released[last[0]] = released.get(last[0], 0) + run
        return released, by_reset, unknown

    def reset(self) -> None:
        """A reset: the loads in flight still copy; their slots stay protected (their epochs
        held) until `reset_flushed`, and their completions go to the old epoch then."""
        for key, held in self._loads.items():
            for _, reset, _ in _held(held):
                self._stale_loads.setdefault(reset, []).append(key)
        self._loads.clear()
        self._pin_batches.clear()
        self._stale_epochs.update(self._epochs)
        self._epochs.clear()

    def reset_flushed(self) -> dict[int, list[bytes]]:
        """Every load in flight at the last reset finished: (reset epoch -> keys, one per
        load) to release at the daemon."""
        stale, self._stale_loads = self._stale_loads, {}
        self._stale_epochs.clear()
        return stale

    def clear(self) -> None:
        """A new session: nothing of the old one is tracked here any more."""
        self._loads.clear()
        self._pin_batches.clear()
        self._epochs.clear()
        self._stale_epochs.clear()
        self._stale_loads.clear()
