"""Blocks a reset dropped while they were being copied: their slots wait for those copies.

`reset()` unpublishes every block at once, but a slot an engine is still reading (pinned) or
writing (a store in flight) must not be reused until that copy ends: it stays a *zombie* of
the old epoch, keyed (epoch, key), until its last load completes or its store completes (any
success value) with that epoch. Only then is the slot freed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .blocks import ABSENT, READY, STORING, BlockTable


class Zombie:
    __slots__ = ("slot", "ref")

    def __init__(self, slot: int, ref: int) -> None:
        self.slot = slot
        self.ref = ref          # -1: a store in flight; n > 0: n loads in flight


class Zombies:
    """A namespace's zombies; the manager frees (or holds) the slots they give back."""

    def __init__(self) -> None:
        self._blocks: dict[tuple[int, bytes], Zombie] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, epoch: int, key: bytes, slot: int, ref: int) -> None:
        self._blocks[(epoch, key)] = Zombie(slot, ref)

    def take_over(self, epoch: int, table: BlockTable) -> list[int]:
        """A reset of `table`, whose blocks are of `epoch`: each block still being copied
        (storing or pinned) becomes a zombie; returns the slots of the others (ready and
        unpinned), free at once."""
        resident = table.resident()
        states = table.state_array[resident]
        busy = states != READY
        for slot, state in zip(resident[busy].tolist(), states[busy].tolist(), strict=True):
            self.add(epoch, table.key_of(slot), slot, -1 if state == STORING else state - READY)
        return resident[states == READY].tolist()

    def completed(self, epoch: int, keys: Sequence[bytes], *, loading: bool,
                  slots: Sequence[int] | None = None,
                  table: BlockTable | None = None) -> Iterator[int]:
        """Loads (`loading`) or stores of `keys` from `epoch`, before a reset, completed: the
        slots free now, one by one as each key settles (the caller frees or holds each).

        With `slots` (where each store wrote) and the namespace's `table`, a store into a slot
        that is neither its key's zombie nor a block now lost a duplicate race: that slot is
        free too."""
        for i, key in enumerate(keys):
            if slots is not None and table is not None:
                slot = slots[i]
                if not self.holds(key, slot) and table.state[slot] == ABSENT:
                    yield slot
                    continue
            freed = self.release(epoch, key, loading=loading)
            if freed is not None:
                yield freed

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
