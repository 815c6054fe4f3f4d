"""A namespace manager's retention: agent sessions' hints turned into refs (manager/retention.py
keeps the bookkeeping; this part of `NamespaceManager` changes the blocks' states and tells the
policy). Apart so that the manager stays one job a module: blocks; this: which of them stay.

A retained block holds one ref on its slot's state, so the policy never picks it (ARC also
takes it out of T1/T2, `Policy.hold`); letting it go drops the ref and, when the block is
READY then, makes it evictable again at its own recency. `make_room` asks `_give_way` when no
other victim is left.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .blocks import READY, STORING

if TYPE_CHECKING:
    from .blocks import BlockTable
    from .policies import Policy
    from .retention import RetainedBlocks


class Retaining:
    """`NamespaceManager`'s retention (see the module doc); the attributes are the manager's."""

    table: BlockTable
    policy: Policy
    retention: RetainedBlocks
    _evictable: int

    def retain(self, keys: Iterable[bytes], tag: str, until: float, room: int
               ) -> tuple[int, int]:
        """An agent session's hint (manager/retention.py): keep the readable blocks of `keys`
        until `until`, tagged `tag`; at most `room` blocks not retained yet (the tenant's
        quota left), the rest counted as cut. Blocks retained already take the later expiry.
        Returns (newly retained, cut)."""
        find, blocks, retention = self.table.find, self.table.state, self.retention
        hold = self.policy.hold
        retained = cut = 0
        for key in keys:
            slot = find(key)
            if slot < 0 or blocks[slot] == STORING:
                continue
            if slot in retention:
                retention.add(slot, tag, until)
                continue
            if retained >= room:
                retention.tag(slot, tag)          # tagged all the same: it can be prewarmed
                cut += 1
                continue
            retention.add(slot, tag, until)
            if blocks[slot] == READY:
                self._evictable -= 1
            blocks[slot] += 1
            hold(slot)
            retained += 1
        retention.counters.cut_total += cut
        return retained, cut

    def _let_go(self, slots: Iterable[int]) -> int:
        """Retained slots retained no more: their refs go, and each block that is READY
        then is evictable again, at its own recency."""
        blocks, retention, unhold = self.table.state, self.retention, self.policy.unhold
        freed: list[int] = []
        n = 0
        for slot in slots:
            if retention.remove(slot):
                n += 1
                blocks[slot] -= 1
                unhold(slot)
                if blocks[slot] == READY:
                    freed.append(slot)
        if freed:
            self._evictable += len(freed)
            self.policy.mark_evictable_many(freed)
        return n

    def expire(self, now: float) -> int:
        """Retained blocks whose hint ran out by `now` become ordinary blocks."""
        due = self.retention.due(now) if self.retention else []
        n = self._let_go(due) if due else 0
        self.retention.counters.expired_total += n
        return n

    def release_tag(self, tag: str) -> int:
        """An agent session released: its retained blocks become ordinary blocks at once, and
        its blocks carry its tag no more (in the pool or below)."""
        n = self._let_go(self.retention.retained_of(tag))
        self.retention.forget_tag(tag)
        self.retention.counters.released_total += n
        return n

    def _arrived(self, keys: Sequence[bytes]) -> None:
        """Blocks became readable: those a prewarm promoted are retained as it asked (its
        quota was counted when it asked)."""
        arriving, retention = self.retention.arriving, self.retention
        blocks, find = self.table.state, self.table.find
        for key in keys:
            wanted = arriving.pop(key, None)
            if wanted is None:
                continue
            slot = find(key)
            if slot < 0 or slot in retention:
                continue
            retention.add(slot, *wanted)
            if blocks[slot] == READY:
                self._evictable -= 1
            blocks[slot] += 1
            self.policy.hold(slot)

    def _give_way(self, n: int) -> bool:
        """No `n` unretained victims are left: the `n` retained blocks that expire first
        (and are not pinned) stop being retained, so they can be evicted. False (nothing
        changed) when fewer than `n` could."""
        retention = self.retention
        if n > len(retention):
            return False
        blocks = self.table.state
        slots = retention.oldest(n, lambda slot: blocks[slot] == READY + 1)
        if len(slots) < n:
            return False
        self._let_go(slots)
        retention.counters.gave_way_total += n
        return True
