"""Random traces for the differential replays, and the harness sizes they are replayed at:
prompts built from a few shared prefixes, private suffixes and re-sent conversations, cut at
MAX_TOKENS; PAGE, the harness's KV bytes per block, and RESERVE, the slots kvd grants an
engine ahead, from which a replay sizes the daemon's pool. Shared by this directory's
differential and store-threshold tests."""

from __future__ import annotations

import random

from bench.traces import Request

MAX_TOKENS = 4000
PAGE = 1024                       # the harness's KV bytes per block (all layers, K and V)
RESERVE = 128                     # slots kvd grants the engine ahead (a few steps' stores)


def random_trace(seed: int) -> list[Request]:
    """Prompts built from a few shared prefixes, private suffixes and re-sent conversations."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50_000) for _ in range(16 * rng.randint(4, 30))]
                for _ in range(3)]
    out: list[Request] = []
    for i in range(10):
        if out and rng.random() < 0.4:
            base = list(rng.choice(out).tokens)              # a conversation goes on
        else:
            base = list(rng.choice(prefixes))
        tail = [rng.randrange(1, 50_000) for _ in range(rng.randint(1, 16 * 20))]
        out.append(Request(session=i, tokens=tuple((base + tail)[:MAX_TOKENS])))
    return out
