"""Hit rate of kvd's LRU and ARC against Belady's optimum, per trace and capacity.

Each request of a trace is replayed the way vLLM's connector drives the manager: look up its
blocks in prefix order (stop at the first miss), load the hits (prepare_load/complete_load),
offer the rest for store (prepare_store/complete_store), then finish the request. Capacities are
fractions of the trace's distinct blocks, so every trace exercises eviction.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belady import belady_hits
from traces import SHAPES, block_keys, generate

from kvd_server.manager.namespace import NamespaceManager
from kvd_server.manager.slots import FixedSlots
from kvd_server.manager.types import Lookup

FRACTIONS = (0.05, 0.1, 0.25, 0.5)


def replay(requests: Sequence[Sequence[bytes]], capacity: int, policy: str) -> tuple[int, int]:
    """(hits, lookups) of kvd's manager with `policy` over the requests."""
    mgr = NamespaceManager(FixedSlots(capacity), policy, enable_events=False)
    hits = lookups = 0
    for n, keys in enumerate(requests):
        req = ("bench", n)
        positions = list(range(1, len(keys) + 1))
        hit = 0
        for key in keys:
            if mgr.lookup(key) is not Lookup.HIT:
                break
            hit += 1
        lookups += len(keys)
        hits += hit
        if hit:
            mgr.prepare_load(keys[:hit], req, positions[:hit])
            mgr.complete_load(keys[:hit], req)
        rest = keys[hit:]
        if rest:
            grant = mgr.prepare_store(rest, req, positions[hit:])
            if grant is not None and grant.keys_to_store:
                mgr.complete_store(grant.keys_to_store, True, req)
        mgr.request_finished(req)
    return hits, lookups


def measure(size: str, block_tokens: int = 16, seed: int = 0) -> dict:
    out: dict = {}
    for shape in SHAPES:
        reqs = [list(block_keys(r.tokens, block_tokens)) for r in generate(shape, size, seed)]
        distinct = len({k for r in reqs for k in r})
        rows = []
        for frac in FRACTIONS:
            cap = max(1, int(distinct * frac))
            row = {"capacity_blocks": cap, "capacity_fraction": frac}
            for policy in ("lru", "arc"):
                t0 = time.perf_counter()
                h, lk = replay(reqs, cap, policy)
                row[policy] = h / lk if lk else 0.0
                row[f"{policy}_seconds"] = time.perf_counter() - t0
            h, lk = belady_hits(reqs, cap)
            row["belady"] = h / lk if lk else 0.0
            rows.append(row)
        out[shape] = {"requests": len(reqs), "distinct_blocks": distinct, "rows": rows}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="small")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    json.dump(measure(args.size, seed=args.seed), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
