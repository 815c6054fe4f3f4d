"""The loads an engine has in flight, and the oldest reclaim epoch they make it publish.

A load copies out of slots the engine found READY in the shared index during one step; the
daemon reuses a freed slot only after every reader's published epoch has passed it, so the
session must keep publishing at most the epoch of the step each load started in until that
load finishes (docs/attach.md, "Reclamation"). `LoadTracker` remembers each pin (the keys one
request started loading in one step) with its (reclaim epoch, reset epoch, request), and
counts loads per reclaim epoch, so the floor to publish is one min() over a handful of epochs.

An engine finishes a load with the keys it started (vLLM does, in any order): that finds its
pin among its request's pins (the newest of the same size holding every key: one membership
test per key, nothing built) and ends it whole; a pin of one record's distinct HITs (what the
compiled pin takes, kvd_proto/_steps.c, or the session's Python path, its twin, on the same
call) carries the COMPLETE_LOAD record its whole end sends (`finish_whole`: encoded at the
pin, while its keys were in the cache, in the pin's order). Anything else (a part of a pin,
keys of several pins, no request named) goes key by key.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from kvd_proto.native import same_set

Load = tuple[int, int, str]                 # a load in flight: (reclaim, reset, req_id)


class _Pin:
    """One pin in flight: its epochs, its keys, which are still loading (None: all), and the
    record its whole completion sends, when the compiled pin made it (`done`)."""

    __slots__ = ("epochs", "keys", "left", "done")

    def __init__(self, epochs: Load, keys: frozenset[bytes], done: bytes | None = None) -> None:
        self.epochs = epochs
        self.keys = keys
        self.left: set[bytes] | None = None
        self.done = done

    def loading(self) -> frozenset[bytes] | set[bytes]:
        return self.keys if self.left is None else self.left


class LoadTracker:
    """Loads in flight (see the module doc)."""

    def __init__(self) -> None:
        # request -> its pins in flight, oldest first (a request may load the same keys
        # again, e.g. after a preemption)
        self._pins: dict[str, list[_Pin]] = {}
        self._epochs: collections.Counter[int] = collections.Counter()
        # epochs of loads that were in flight at a reset: they still copy (the engine finishes
        # them) and stay protected until reset_flushed
        self._stale_epochs: collections.Counter[int] = collections.Counter()
        self._stale_loads: dict[int, list[bytes]] = {}

    def __len__(self) -> int:
        """Loads in flight (a key several requests load counts each)."""
        return sum(len(p.loading()) for pins in self._pins.values() for p in pins)

    @property
    def in_flight(self) -> int:
        """Blocks whose loads started and have not finished (current loads; a handful of epochs to add)."""
        return sum(self._epochs.values())

    @property
    def holding(self) -> bool:
        """Whether any load (current or from before a reset) still holds back reuse."""
        return bool(self._epochs or self._stale_epochs)

    def floor(self, step_epoch: int) -> int:
        """The epoch to publish at a step whose index reads `step_epoch`."""
        if not self._epochs and not self._stale_epochs:
            return step_epoch
        return min(step_epoch, *self._epochs, *self._stale_epochs)

    def start(self, loaded: Sequence[bytes], epochs: Load, done: bytes | None = None) -> bool:
        """Loads of `loaded` started under `epochs` (a key named twice loads once); whether
        the keys were distinct. `done`: the COMPLETE_LOAD record of the whole pin, kept for
        `finish_whole` when they were."""
        keys = frozenset(loaded)
        distinct = len(keys) == len(loaded)
        self.start_distinct(keys, epochs, done if distinct else None)
        return distinct

    def start_distinct(self, keys: frozenset[bytes], epochs: Load,
                       done: bytes | None = None) -> None:
        """`start` of keys known distinct, as one set (the compiled pin path makes it, and
        `done`: the COMPLETE_LOAD record of the whole pin, for `finish_whole`)."""
        pins = self._pins.get(epochs[2])
        if pins is None:
            self._pins[epochs[2]] = [_Pin(epochs, keys, done)]
        else:
            pins.append(_Pin(epochs, keys, done))
        self._epochs[epochs[0]] += len(keys)

    def _release(self, reclaim: int, n: int) -> None:
        epochs = self._epochs
        left = epochs[reclaim] - n
        if left > 0:
            epochs[reclaim] = left
        else:
            del epochs[reclaim]

    def _take_whole(self, keys: Sequence[bytes], req_id: str, *, recorded: bool) -> _Pin | None:
        """End and return the newest pin of `req_id` that `keys` are exactly (vLLM's job set,
        built from the list the pin's set was: one pass over both tables, kvd_proto native
        `same_set`; else one membership test per key; nothing built; with `recorded`, only one
        made with its completion record). None: no such pin, or a key named
        twice (key by key then)."""
        pins = self._pins.get(req_id)
        if not pins:
            return None
        n = len(keys)
        for i in range(len(pins) - 1, -1, -1):
            pin = pins[i]           # the newest first: a floor too low only waits longer
            if pin.left is None and len(pin.keys) == n and (
                    same_set(pin.keys, keys) or pin.keys.issuperset(keys)):
                if (recorded and pin.done is None) or \
                        (not isinstance(keys, (set, frozenset)) and len(set(keys)) != n):
                    return None
                del pins[i]
                if not pins:
                    del self._pins[req_id]
                self._release(pin.epochs[0], n)
                return pin
        return None

    def finish_whole(self, keys: Sequence[bytes], req_id: str) -> bytes | None:
        """The common finish: `keys` are exactly a pin of `req_id` made with its completion
        record (`start`'s `done`): that pin ends, and its record is what to send (its keys
        were read while they were in the cache). None: not so (`finish` decides)."""
        pin = self._take_whole(keys, req_id, recorded=True)
        return None if pin is None else pin.done

    def finish(self, keys: Sequence[bytes], req_id: str) -> tuple[dict[int, list[bytes]], int]:
        """Loads of `keys` finished: (keys per reset epoch, to complete at the daemon, each
        list without repeats; keys that were not loading, e.g. loads of an earlier
        session)."""
        if not keys:
            return {}, 0
        pin = self._take_whole(keys, req_id, recorded=False)
        if pin is not None:
            return {pin.epochs[1]: keys if isinstance(keys, list) else list(keys)}, 0
        return self._finish_each(keys, req_id)

    def _finish_each(self, keys: Sequence[bytes], req_id: str
                    ) -> tuple[dict[int, list[bytes]], int]:
        """finish, key by key: (keys per reset epoch, keys not loading).

        A key several requests load ends the load of `req_id`; failing that (an engine that
        names no requests) the newest, so the loads left hold the older epochs: a floor too
        low holds freed slots back a little longer, one too high could hand a slot still
        being read to a new store."""
        holders: dict[bytes, list[tuple[str, _Pin]]] = {}
        for where, pins in self._pins.items():
            for pin in pins:
                for key in pin.loading():
                    holders.setdefault(key, []).append((where, pin))
        by_reset: dict[int, list[bytes]] = {}
        unknown = 0
        for key in dict.fromkeys(keys):          # a key named twice ends one load
            held = [h for h in holders.get(key, ()) if key in h[1].loading()]
            if not held:
                unknown += 1
                continue
            mine = [h for h in held if h[1].epochs[2] == req_id]
            where, pin = max(mine or held, key=lambda h: h[1].epochs)
            if pin.left is None:
                pin.left = set(pin.keys)
            pin.left.discard(key)
            if not pin.left:
                self._pins[where].remove(pin)
                if not self._pins[where]:
                    del self._pins[where]
            self._release(pin.epochs[0], 1)
            by_reset.setdefault(pin.epochs[1], []).append(key)
        return by_reset, unknown

    def reset(self) -> None:
        """A reset: the loads in flight still copy; their slots stay protected (their epochs
        held) until `reset_flushed`, and their completions go to the old epoch then."""
        for pins in self._pins.values():
            for pin in pins:
                self._stale_loads.setdefault(pin.epochs[1], []).extend(pin.loading())
        self._pins.clear()
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
        self._pins.clear()
        self._epochs.clear()
        self._stale_epochs.clear()
        self._stale_loads.clear()
