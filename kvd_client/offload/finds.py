"""Keys this engine asked the daemon to look for in the cluster store.

In a namespace shared through a cluster store, a block another node published is in the
store and nowhere on this node: neither the shared index nor the "held below" table names
it. The table's FLAG_ASK (kvd_proto/below_layout.py) says so; then a lookup of a key that
neither names is not a MISS at once: the key goes into the step's FIND record, and the daemon
asks the store about every key of the step in one batched existence call and answers
FOUND(step), having named what the store holds in the held-below table. From the next step
the key reads HIT_PENDING (then promoted, as any key held below) or, found nowhere, MISS.

Until that answer the lookup answers "not known yet" (vLLM's RETRY: the request waits a step
and the connector keeps scanning its keys, so a whole prefix is asked in one step) with
FLAG_WAIT, else MISS at once (the engine computes; later requests find the block). Bounded:
MAX_PER_STEP keys asked a step, an answer waited for at most WAIT_S, a key the store did not
hold not asked again for NEGATIVE_S, MAX_REMEMBERED keys remembered. The scheduler thread
never waits: everything here is a dict lookup.
"""

from __future__ import annotations

import time

MAX_PER_STEP = 512            # keys one step asks about (past it: MISS)
WAIT_S = 0.5                  # an answer not come in this long: MISS (a slow or hung store)
NEGATIVE_S = 1.0              # a key the store did not hold reads MISS this long, unasked
MAX_REMEMBERED = 1 << 16      # asked and negative keys remembered (cleared when full)


class Finds:
    """The keys this session asked the daemon to find (scheduler thread; see the module doc)."""

    def __init__(self) -> None:
        self.asked: dict[bytes, tuple[int, float]] = {}    # key -> (step, when)
        self._negative: dict[bytes, float] = {}             # key -> when it read MISS
        self.to_send: list[bytes] = []                      # this step's keys
        self.answered = -1            # the last step whose FIND the daemon answered
        self._last: tuple[int, float] = (-1, 0.0)          # the last ask's step and time
        self.asked_total = 0

    def answer(self, key: bytes, step: int) -> bool:
        """For a key neither the index nor the held-below table names: True (asked, the
        answer not in yet: "not known yet") or False (a MISS)."""
        now = time.monotonic()
        asked = self.asked.get(key)
        if asked is not None:
            asked_step, when = asked
            if asked_step > self.answered and now - when < WAIT_S:
                return True
            del self.asked[key]               # answered, and not found (or too late)
            self._remember(key, now)
            return False
        seen = self._negative.get(key)
        if seen is not None:
            if now - seen < NEGATIVE_S:
                return False
            del self._negative[key]
        if len(self.to_send) >= MAX_PER_STEP:
            return False
        if len(self.asked) >= MAX_REMEMBERED:
            self.asked.clear()
        self.asked[key] = self._last = (step, now)
        self.to_send.append(key)
        self.asked_total += 1
        return True

    def _remember(self, key: bytes, now: float) -> None:
        if len(self._negative) >= MAX_REMEMBERED:
            self._negative.clear()
        self._negative[key] = now

    def take(self) -> list[bytes]:
        """This step's keys to ask about."""
        keys, self.to_send = self.to_send, []
        return keys

    def found(self, step: int) -> None:
        """The daemon answered the FIND records up to `step`."""
        if step > self.answered:
            self.answered = step

    def waiting(self) -> bool:
        """Whether an answer may still come (keep the engine stepping until it does)."""
        step, when = self._last
        return step > self.answered and time.monotonic() - when < WAIT_S

    def clear(self) -> None:
        """A new connection: asks of the old one will not be answered."""
        self.asked.clear()
        self.to_send.clear()
        self.answered = -1
