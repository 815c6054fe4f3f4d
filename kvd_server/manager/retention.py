"""A namespace's agent-session blocks: which slots a session's hint keeps in the pool (until
when), which blocks carry which session's tag, and which of its blocks went below the pool.

A retained block holds one ref on its slot's state (as a lease does), so no policy picks it:
it is evicted only when no other victim is left, and then the retained blocks whose hints
expire first give way first (`oldest`). A hinted block carries its session's tag ("" for a
hint that named none) as long as it is in the pool, retained or not (an expired hint leaves
the tag: the session may come back); when it is evicted into a tier below, its key is
remembered under the tag (`below`, bounded), so a prewarm of the session can promote it back.
Keys a prewarm promotes are retained as they arrive (`arriving`).

Pure bookkeeping: the manager (manager/namespace.py) turns the refs on and off and tells the
policy; this keeps per slot its expiry and tag, the slots of each tag, a heap of expiries
(stale entries skipped, rebuilt when they outnumber the live ones), the keys below per tag
and the keys on their way back.

Warm restart: bound to memory that outlives the daemon (`bind`: one int64 per slot beside the
policy's order), each retained slot's word is `tag id << 32 | expiry` (unix seconds; 0: not
retained), kept in step as retention changes; the tag names are the ids' (`tag_names`, id 1
first), told to whoever keeps them (`on_new_tag`: the warm-restart record) as a tag gets an id.
A restarted daemon's manager reads them back for the blocks it adopts (`persisted`).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_BELOW_KEYS = 1 << 16        # keys of tagged blocks remembered below the pool (a namespace)
MAX_ARRIVING = 1 << 16          # keys a prewarm promotes, until they arrive
MAX_PERSISTED_TAGS = 4096       # tags a namespace's warm-restart record names (later: untagged)
_EXPIRY_MASK = (1 << 32) - 1


@dataclass(slots=True)
class RetentionCounters:
    """What hints did to a tenant's blocks (stats: `retention` rows)."""

    retained_total: int = 0       # blocks that became retained
    cut_total: int = 0            # blocks a hint asked for past the tenant's quota (not retained)
    expired_total: int = 0        # retained blocks whose hint ran out
    released_total: int = 0       # retained blocks let go by a release of their session
    gave_way_total: int = 0       # retained blocks given up because no other victim was left
    prewarmed_total: int = 0      # blocks prewarms started promoting into the pool
    prewarm_hits_total: int = 0   # prewarmed blocks an engine then loaded


@dataclass(slots=True)
class TagView:
    """One session tag of a namespace."""

    tag: str
    retained: int         # retained blocks in the pool
    tagged: int           # blocks in the pool carrying the tag (retained or not)
    below: int            # its blocks remembered below the pool
    until: float          # the latest expiry of its retained blocks (0: none retained)


class RetainedBlocks:
    """A namespace's agent-session blocks (see the module doc)."""

    __slots__ = ("until", "tag_of", "by_tag", "below", "arriving", "prewarmed", "_heap",
                 "_below_count", "counters", "_words", "_wall", "tag_ids", "tag_names",
                 "on_new_tag")

    def __init__(self) -> None:
        self.until: dict[int, float] = {}           # retained slot -> expiry
        self.tag_of: dict[int, str] = {}            # tagged slot -> tag
        self.by_tag: dict[str, set[int]] = {}       # tag -> its tagged slots
        self.below: dict[str, dict[bytes, None]] = {}   # tag -> keys evicted below the pool
        self.arriving: dict[bytes, tuple[str, float]] = {}   # promoted key -> (tag, until)
        self.prewarmed: dict[bytes, None] = {}      # keys a prewarm brought back (bounded)
        self._heap: list[tuple[float, int]] = []
        self._below_count = 0
        self.counters = RetentionCounters()
        # Warm restart (`bind`): a word per slot in memory that outlives the daemon, and the
        # tags' ids (id 1 = tag_names[0]).
        self._words: Any = None
        self._wall = 0.0              # unix time - the manager's (monotonic) clock
        self.tag_ids: dict[str, int] = {}
        self.tag_names: list[str] = []
        self.on_new_tag: Callable[[], None] | None = None

    # ------------------------------------------------------ warm restart
    def bind(self, words: np.ndarray) -> None:
        """Keep each retained slot's word in `words` (int64 per slot, outliving the daemon)."""
        self._words = memoryview(words)
        self._wall = time.time() - time.monotonic()

    def _persist(self, slot: int) -> None:
        tag = self.tag_of.get(slot, "")
        tag_id = self.tag_ids.get(tag, 0) if tag else 0
        if tag and not tag_id and len(self.tag_names) < MAX_PERSISTED_TAGS:
            self.tag_names.append(tag)
            tag_id = self.tag_ids[tag] = len(self.tag_names)
            if self.on_new_tag is not None:
                self.on_new_tag()
        expiry = min(_EXPIRY_MASK, math.ceil(self.until[slot] + self._wall))
        self._words[slot] = tag_id << 32 | expiry

    def load_tags(self, names: Sequence[str]) -> None:
        """The tag names a previous daemon's record kept (ids from 1)."""
        self.tag_names = list(names)[:MAX_PERSISTED_TAGS]
        self.tag_ids = {name: i for i, name in enumerate(self.tag_names, 1)}

    def persisted(self, slots: np.ndarray) -> list[tuple[int, str, float]]:
        """Of `slots` (adopted READY blocks), those a previous daemon retained and whose
        hint runs on: (slot, tag, expiry on this daemon's clock); every other word cleared."""
        words = self._words
        if words is None or not len(slots):
            return []
        array = np.frombuffer(words, dtype=np.int64)
        values = array[slots]
        now = time.time()
        live = (values & _EXPIRY_MASK) > now
        chosen, chosen_values = slots[live], values[live]
        array[:] = 0
        out = []
        names = self.tag_names
        for slot, value in zip(chosen.tolist(), chosen_values.tolist(), strict=True):
            tag_id = value >> 32
            tag = names[tag_id - 1] if 0 < tag_id <= len(names) else ""
            out.append((slot, tag, (value & _EXPIRY_MASK) - self._wall))
        return out

    def __len__(self) -> int:
        return len(self.until)

    def __contains__(self, slot: object) -> bool:
        return slot in self.until

    def __bool__(self) -> bool:
        return bool(self.until or self.tag_of or self.below or self.arriving)

    # -------------------------------------------------------------- tags
    def tag(self, slot: int, tag: str) -> None:
        """`slot`'s block carries `tag` from now on (a later hint's tag replaces it; one
        that names no session, "", leaves a session's tag as it was)."""
        before = self.tag_of.get(slot)
        if before == tag or (not tag and before is not None):
            return
        if before is not None:
            self._untag(slot, before)
        self.tag_of[slot] = tag
        self.by_tag.setdefault(tag, set()).add(slot)

    def _untag(self, slot: int, tag: str) -> None:
        slots = self.by_tag.get(tag)
        if slots is not None:
            slots.discard(slot)
            if not slots:
                del self.by_tag[tag]

    def evicted(self, victims: Iterable[tuple[bytes, int]], kept: Collection[bytes]) -> None:
        """Blocks left the pool: their tags go; a tagged one a tier below `kept` is
        remembered under its tag (the oldest forgotten past MAX_BELOW_KEYS)."""
        tag_of = self.tag_of
        for key, slot in victims:
            tag = tag_of.pop(slot, None)
            if tag is None:
                continue
            self._untag(slot, tag)
            if key in kept:
                keys = self.below.setdefault(tag, {})
                if key not in keys:
                    keys[key] = None
                    self._below_count += 1
        while self._below_count > MAX_BELOW_KEYS:
            tag = next(iter(self.below))
            keys = self.below[tag]
            del keys[next(iter(keys))]
            self._below_count -= 1
            if not keys:
                del self.below[tag]

    def below_keys(self, tag: str) -> list[bytes]:
        return list(self.below.get(tag, ()))

    def forget_tag(self, tag: str) -> None:
        """The session is over: its blocks carry its tag no more, its keys below are
        forgotten (release)."""
        for slot in self.by_tag.pop(tag, ()):
            del self.tag_of[slot]
        self._below_count -= len(self.below.pop(tag, ()))
        for key in [k for k, (t, _) in self.arriving.items() if t == tag]:
            del self.arriving[key]

    # --------------------------------------------------------- retention
    def add(self, slot: int, tag: str, until: float) -> bool:
        """Retain `slot` until `until` with `tag`; an already retained slot takes the later
        expiry and the new tag. True when the slot was not retained before."""
        old = self.until.get(slot)
        fresh = old is None
        if old is not None and old >= until:
            until = old
        self.until[slot] = until
        before = self.tag_of.get(slot)
        self.tag(slot, tag)
        if until != old:
            heapq.heappush(self._heap, (until, slot))
            if len(self._heap) > 2 * len(self.until) + 64:
                self._heap = [(u, s) for s, u in self.until.items()]
                heapq.heapify(self._heap)
        if self._words is not None and (until != old or self.tag_of[slot] != before):
            self._persist(slot)
        if fresh:
            self.counters.retained_total += 1
        return fresh

    def remove(self, slot: int) -> bool:
        """`slot` is no longer retained (it keeps its tag; its heap entry goes stale)."""
        if self.until.pop(slot, None) is None:
            return False
        if self._words is not None:
            self._words[slot] = 0
        return True

    def due(self, now: float) -> list[int]:
        """Retained slots whose expiry is at or before `now` (still retained: the caller
        removes them)."""
        heap, until = self._heap, self.until
        out = []
        while heap and heap[0][0] <= now:
            at, slot = heapq.heappop(heap)
            if until.get(slot) == at:
                out.append(slot)
        return out

    def oldest(self, n: int, eligible: Callable[[int], bool]) -> list[int]:
        """Up to `n` retained slots that are `eligible`, those expiring first; the heap keeps
        every entry (the caller removes the slots it takes)."""
        heap, until = self._heap, self.until
        taken: list[int] = []
        aside: list[tuple[float, int]] = []
        while heap and len(taken) < n:
            entry = heapq.heappop(heap)
            if until.get(entry[1]) != entry[0]:
                continue                        # stale
            aside.append(entry)
            if eligible(entry[1]):
                taken.append(entry[1])
        for entry in aside:
            heapq.heappush(heap, entry)
        return taken

    def retained_of(self, tag: str) -> list[int]:
        until = self.until
        return [slot for slot in self.by_tag.get(tag, ()) if slot in until]

    # ----------------------------------------------------------- prewarm
    def expect(self, keys: Sequence[bytes], tag: str, until: float) -> None:
        """Keys a prewarm is promoting: retained with `tag` until `until` as they arrive."""
        arriving = self.arriving
        for key in keys:
            if len(arriving) >= MAX_ARRIVING:
                del arriving[next(iter(arriving))]
            arriving[key] = (tag, until)

    def mark_prewarmed(self, keys: Iterable[bytes]) -> None:
        """Keys a prewarm brought back: loads of them count as its hits (`loaded`)."""
        prewarmed = self.prewarmed
        for key in keys:
            if len(prewarmed) >= MAX_ARRIVING:
                del prewarmed[next(iter(prewarmed))]
            prewarmed[key] = None

    def loaded(self, keys: Iterable[bytes]) -> None:
        """An engine loaded `keys`: those a prewarm brought back count as its hits."""
        prewarmed = self.prewarmed
        for key in keys:
            if key in prewarmed:
                del prewarmed[key]
                self.counters.prewarm_hits_total += 1

    # ---------------------------------------------------------- listing
    def tags(self) -> list[TagView]:
        until = self.until
        out = []
        for tag in set(self.by_tag) | set(self.below):
            slots = self.by_tag.get(tag, ())
            expiries = [until[s] for s in slots if s in until]
            out.append(TagView(tag, len(expiries), len(slots), len(self.below.get(tag, ())),
                               max(expiries, default=0.0)))
        return out

    def clear(self) -> list[int]:
        """Forget everything (a reset: the blocks are gone, below too); the slots that were
        retained."""
        slots = list(self.until)
        if self._words is not None:
            for slot in slots:
                self._words[slot] = 0
        self.until.clear()
        self.tag_of.clear()
        self.by_tag.clear()
        self.below.clear()
        self.arriving.clear()
        self.prewarmed.clear()
        self._heap.clear()
        self._below_count = 0
        return slots
