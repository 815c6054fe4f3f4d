"""Belady's optimal (MIN) replacement, the upper bound a policy's hit rate is compared with.

Offline: knowing the whole access sequence, evict the resident block whose next use is
farthest in the future. Accesses follow the replay model of `hitrate.py`: each request looks up
its blocks in prefix order (hits stop at the first miss, as vLLM's lookup does) and then stores
the blocks it had to compute. The optimum here is for the same "demand" model: every accessed
block is admitted.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def next_use_indices(accesses: Sequence[bytes]) -> list[int]:
    """For each access i, the index of the next access to the same key (len if none)."""
    n = len(accesses)
    nxt = [n] * n
    last: dict[bytes, int] = {}
    for i in range(n - 1, -1, -1):
        key = accesses[i]
        nxt[i] = last.get(key, n)
        last[key] = i
    return nxt


def belady_hits(requests: Sequence[Sequence[bytes]], capacity: int) -> tuple[int, int]:
    """Hits and lookups of the optimal policy, with prefix-hit semantics per request.

    A request's blocks are accessed in order; a block counts as a hit only while every block
    before it in the same request hit. Returns (hits, lookups).
    """
    accesses = [key for req in requests for key in req]
    nxt = next_use_indices(accesses)
    resident: dict[bytes, int] = {}          # key -> its next use index
    heap: list[tuple[int, bytes]] = []       # (-next_use, key), lazily invalidated
    hits = lookups = 0
    i = 0
    for req in requests:
        prefix = True
        for key in req:
            lookups += 1
            present = key in resident
            if present and prefix:
                hits += 1
            else:
                prefix = False
            if not present and capacity > 0:
                while len(resident) >= capacity:
                    neg, victim = heapq.heappop(heap)
                    if resident.get(victim) == -neg:
                        del resident[victim]
                resident[key] = -1
            if key in resident:
                resident[key] = nxt[i]
                heapq.heappush(heap, (-nxt[i], key))
            i += 1
    return hits, lookups
