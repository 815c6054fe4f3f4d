"""An engine on the shared-index fast path (the real OffloadSession) that keeps storing,
looking up, loading and resetting while its daemon is killed and restarted under it
(tests/fault/test_warm_restart_faults.py).

Every block's bytes follow from its key (`block_bytes_of`), written rank shard by rank shard
as the engine's TP workers would; every HIT it loads is checked byte for byte, including
loads started before a daemon died and finished after the next one adopted the pool. Some
stores are left unfinished across a step (a daemon killed then dies mid-store), some fail,
a few steps reset the namespace. It never waits for the daemon: while none is up, lookups
miss and stores are declined. Runs DURATION seconds, then prints one JSON line of counts.

Keys are hybrid-model keys when GROUPS > 1: one logical block is GROUPS keys, the group index
in their last 4 bytes (vLLM's offload keys).

Usage: python -m tests.fault.warm_worker SOCKET MODEL SEED DURATION UNIVERSE BLOCK RANKS GROUPS
"""

from __future__ import annotations

import json
import random
import sys
import time

from kvd_client.client import KvdClient
from kvd_client.offload.session import Lookup, OffloadSession
from kvd_proto.wire import KvLayout
from tests.support.engine import block_bytes_of


def universe(seed: str, n: int, groups: int) -> list[bytes]:
    """`n` logical blocks' keys: GROUPS keys each (group index last, as vLLM's)."""
    import hashlib

    out = []
    for i in range(n):
        base = hashlib.sha256(f"{seed}/{i}".encode()).digest()[:20]
        out += [base + g.to_bytes(4, "big") for g in range(groups)]
    return out


def main(socket: str, model: str, seed: str, duration: float, n: int, block: int,
         ranks: int, groups: int) -> int:
    rng = random.Random(seed)
    keys = universe(model, n, groups)
    layout = KvLayout(block, ranks, block // ranks, 16, "bfloat16", 24)
    client = KvdClient(socket, model=model, layout=layout, deadline_s=0.5)
    session = OffloadSession(client, reserve=16)
    client.wait_available(10)
    shard = block // ranks
    counts = {"steps": 0, "stored": 0, "failed": 0, "hits": 0, "loads_checked": 0,
              "corrupt": 0, "resets": 0, "unfinished": 0, "declined": 0}
    pending: list[bytes] = []                # stores written, completed next step
    loading: list[tuple[bytes, int]] = []    # loads started, read next step ...
    loading_pool = None                      # ... through the mapping they started in
    end = time.monotonic() + duration
    while time.monotonic() < end:
        counts["steps"] += 1
        # Finish last step's loads and stores (the daemon may have died and come back since).
        if loading:
            for key, offset in loading:
                view = loading_pool.view(offset, block)
                data = bytes(view)
                view.release()
                counts["loads_checked"] += 1
                if data != block_bytes_of(key, block):
                    counts["corrupt"] += 1
            session.finish_loads([k for k, _ in loading], "r")
            loading = []
        if pending:
            ok = rng.random() < 0.9
            session.complete_store(pending, "w", success=ok)
            counts["stored" if ok else "failed"] += len(pending)
            pending = []
        if rng.random() < 0.02:
            session.reset()
            session.reset_flushed()          # no copy is in flight here
            counts["resets"] += 1
            session.end_step()
            continue
        batch = rng.sample(range(n), 4)
        step_keys = [k for i in batch for k in keys[i * groups:(i + 1) * groups]]
        states = [session.lookup(k) for k in step_keys]
        hits = [k for k, s in zip(step_keys, states, strict=True) if s == Lookup.HIT]
        counts["hits"] += len(hits)
        if hits and client.pool is not None:
            loading_pool = client.pool
            offsets = session.start_loads(hits, "r")
            loading = [(k, o) for k, o in zip(hits, offsets, strict=True) if o is not None]
        misses = [k for k, s in zip(step_keys, states, strict=True) if s == Lookup.MISS]
        stored = session.store_slots(misses, "w") if misses else None
        if stored is None and misses:
            counts["declined"] += 1
        elif stored is not None and stored[0] and client.pool is not None:
            new, offsets = stored
            pool = client.pool
            for key, offset in zip(new, offsets, strict=True):
                data = block_bytes_of(key, block)
                for r in range(ranks):        # each TP rank writes its shard
                    view = pool.view(offset + r * shard, shard)
                    view[:] = data[r * shard:(r + 1) * shard]
                    view.release()
            if rng.random() < 0.2:
                pending = list(new)          # completed next step: a kill lands mid-store
                counts["unfinished"] += 1
            else:
                ok = rng.random() < 0.95
                session.complete_store(new, "w", success=ok)
                counts["stored" if ok else "failed"] += len(new)
        session.end_step()
        time.sleep(0.002)
    if loading:
        session.finish_loads([k for k, _ in loading], "r")
    if pending:
        session.complete_store(pending, "w", success=True)
        counts["stored"] += len(pending)
    session.end_step()
    session.close()
    client.close()
    print(json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(main(a[0], a[1], a[2], float(a[3]), int(a[4]), int(a[5]), int(a[6]), int(a[7])))
