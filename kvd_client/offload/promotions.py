"""Keys held below the pool that this engine asked the daemon to promote.

A lookup that misses the shared index but finds the key in the namespace's "held below" table
(kvd_proto/below_layout.py) answers HIT_PENDING and asks for the key (a PROMOTE record at the
step's end). Once the daemon has read that record the index answers for the key: being stored
(the promotion runs: still HIT_PENDING) or ready (a HIT). If it shows nothing, the daemon had
no pool slot for it yet (evicted ones wait for readers to move past them) and the key is asked
for again, for up to ASK_FOR_S seconds (steps may come every fraction of a millisecond, so
this is a time, not a count of asks); a failed promotion (a corrupt block, an I/O error) also takes
the key out of the table, and either way the key then reads MISS and is not asked for again
for RETRY_AFTER_STEPS steps, so a request never waits long on a block the pool cannot take.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvd_client.link.index_reader import STATE_STORING

MAX_ASKED = 4096              # promotions asked for and not settled, at most
ASK_FOR_S = 1.0               # how long a key is asked for again before it reads MISS
REASK_S = 0.002               # not more often than this (the daemon frees slots per step)
RETRY_AFTER_STEPS = 64        # a key whose promotion came to nothing is a MISS this long
MAX_TRIED = 1 << 16           # keys remembered for that (cleared when full: a bound)


class Promotions:
    """The promotions this session asked for (scheduler thread; see the module doc)."""

    def __init__(self) -> None:
        self.asked: dict[bytes, int] = {}      # key -> the step whose PROMOTE names it
        self._first: dict[bytes, float] = {}   # key -> when it was first asked for
        self._last: dict[bytes, float] = {}    # key -> when it was last asked for
        self.to_send: list[bytes] = []         # this step's keys, for its PROMOTE
        self._tried: dict[bytes, int] = {}     # key -> the step it read MISS after one
        self._swept = -1                       # the step the asks were last swept at
        self.asked_total = 0

    def answer(self, key: bytes, step: int, acked: int, below: Callable[[bytes], bool],
               find: Callable[[bytes], tuple[int, int] | None] | None = None) -> bool:
        """For a key the index does not hold (nor this engine's own stores): True (pending:
        asked now, or the daemon has not read the ask yet) or False (a MISS). `find`: the
        index's probe, to forget the settled asks once MAX_ASKED are remembered (a promoted
        key reads HIT from the index without coming here again)."""
        asked = self.asked.get(key)
        if asked is not None:
            if asked > acked:
                return True
            first = self._first.get(key, 0.0)
            now = time.monotonic()
            if now - first < ASK_FOR_S and below(key):       # no slot yet: ask again, at
                if now - self._last.get(key, 0.0) >= REASK_S:  # most every REASK_S
                    self._ask(key, step, first)
                return True
            del self.asked[key]                # asked long enough, or it failed: a MISS
            self._first.pop(key, None)
            self._last.pop(key, None)
            if len(self._tried) >= MAX_TRIED:
                self._tried.clear()
            self._tried[key] = step
            return False
        tried = self._tried.get(key)
        if tried is not None and step - tried < RETRY_AFTER_STEPS:
            return False
        if len(self.asked) >= MAX_ASKED and find is not None and step != self._swept:
            self._swept = step                 # at most once a step, and only when full
            self.waiting(acked, find)
        if len(self.asked) >= MAX_ASKED or not below(key):
            return False
        self._ask(key, step, time.monotonic())
        self.asked_total += 1
        return True

    def _ask(self, key: bytes, step: int, first: float) -> None:
        self.asked[key] = step
        self._first[key] = first
        self._last[key] = time.monotonic()
        self.to_send.append(key)

    def take(self) -> list[bytes]:
        """This step's keys to ask for."""
        keys, self.to_send = self.to_send, []
        return keys

    def waiting(self, acked: int, find: Callable[[bytes], tuple[int, int] | None]) -> bool:
        """Whether a promotion asked for may still be running (the daemon has not read the
        ask, or the index shows the key being stored); settled ones are forgotten."""
        for key, step in list(self.asked.items()):
            if step <= acked:
                found = find(key)
                if found is None or found[0] != STATE_STORING:
                    del self.asked[key]
                    self._first.pop(key, None)
                    self._last.pop(key, None)
        return bool(self.asked)

    def clear(self) -> None:
        self.asked.clear()
        self._first.clear()
        self._last.clear()
        self.to_send.clear()
        self._tried.clear()
