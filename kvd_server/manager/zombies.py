"""Blocks a reset dropped while they were being copied: their slots wait for those copies.

`reset()` unpublishes every block at once, but a slot an engine is still reading (pinned) or
writing (a store in flight) must not be reused until that copy ends: it stays a *zombie* of
the old epoch, keyed (epoch, key), until its last load completes or its store completes (any
success value) with that epoch. Only then is the slot freed.
"""

from __future__ import annotations


class Zombie:
    __slots__ = ("slot", "ref")

    def __init__(self, slot: int, ref: int) -> None:
        self.slot = slot
        self.ref = ref          # -1: a store in flight; n > 0: n loads in flight


class Zombies:
    def __init__(self) -> None:
        self._blocks: dict[tuple[int, bytes], Zombie] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, epoch: int, key: bytes, slot: int, ref: int) -> None:
        self._blocks[(epoch, key)] = Zombie(slot, ref)

    def release(self, epoch: int, key: bytes, *, loading: bool) -> int | None:
        """A load (`loading`) or a store of `key` from `epoch` completed: the zombie's slot
        when that was its last copy (the caller frees it), else None."""
        zkey = (epoch, key)
        block = self._blocks.get(zkey)
        if block is None:
            return None
        if loading and block.ref > 0:
            block.ref -= 1
            if block.ref > 0:
                return None
        elif loading or block.ref >= 0:
            return None  # a store completion for a pinned zombie, or the reverse: not ours
        del self._blocks[zkey]
        return block.slot

    def slots(self) -> list[int]:
        """Every zombie's slot."""
        return [block.slot for block in self._blocks.values()]

    def holds(self, key: bytes, slot: int) -> bool:
        """Whether `slot` is the zombie of `key` (of any epoch)."""
        return any(zkey == key and block.slot == slot
                   for (_, zkey), block in self._blocks.items())
