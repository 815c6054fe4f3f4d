"""One of many engines hammering the daemon at once (tests/fault/test_load.py).

Waits for a line on stdin, then for DURATION seconds stores (prepare, write the key's bytes,
complete with success or failure), looks up with leases and loads (checking every byte) over a
key universe shared with the other workers, so stores contend and the pool evicts. Prints one
JSON line with what it did; the test compares the sums with the daemon's own counters.

Usage: python -m tests.fault.load_worker SOCKET SEED DURATION UNIVERSE
"""

from __future__ import annotations

import json
import random
import sys
import time

import grpc

from kvd_proto import kvd_pb2
from tests.support.engine import Engine, block_bytes_of, keys_for

MODEL = "load-model"
BLOCK = 16 * 1024


def main(socket: str, seed: str, duration: float, universe_n: int,
         reset_p: float = 0.0) -> int:
    rng = random.Random(seed)
    universe = keys_for("load", universe_n)
    engine = Engine(socket, MODEL, block=BLOCK, engine_id=f"load-{seed}")
    rec = {"granted": 0, "completed": 0, "failed": 0, "mismatched": 0, "cannot_store": 0,
           "loads": 0, "load_races": 0, "corrupt": 0, "steps": 0, "evicted_seen": 0,
           "resets": 0, "slowest_step_s": 0.0}
    print("ready", flush=True)
    sys.stdin.readline()
    end = time.monotonic() + duration

    def one_step() -> None:
        keys = rng.sample(universe, 8)
        if rng.random() < reset_p:
            engine.call("Reset", kvd_pb2.ResetRequest())
            rec["resets"] += 1
        elif rng.random() < 0.5:
            grant = engine.call("PrepareStore", kvd_pb2.PrepareStoreRequest(keys=keys, req_id=seed))
            rec["cannot_store"] += grant.cannot_store
            rec["evicted_seen"] += len(grant.evicted_keys)
            if not grant.keys_to_store:
                return
            rec["granted"] += len(grant.keys_to_store)
            for key, offset in zip(grant.keys_to_store, grant.slot_offsets, strict=True):
                engine.write(offset, block_bytes_of(key, BLOCK))
            ok = rng.random() < 0.9
            out = engine.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
                keys=grant.keys_to_store, success=ok, req_id=seed, epoch=grant.epoch,
                slot_offsets=grant.slot_offsets))
            rec["mismatched"] += out.mismatched
            if ok:
                rec["completed"] += out.completed
            else:
                rec["failed"] += len(grant.keys_to_store)
        else:
            res = engine.lookup(keys, lease_ms=rng.choice([0, 1000]))
            hits = [k for k, s in zip(keys, res.states, strict=True)
                    if s == kvd_pb2.BLOCK_STATE_HIT]
            if not hits:
                return
            try:
                out = engine.call("PrepareLoad", kvd_pb2.PrepareLoadRequest(keys=hits,
                                                                             req_id=seed))
            except grpc.RpcError as err:        # evicted between an unleased lookup and here
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                rec["load_races"] += 1
                return
            for key, offset in zip(hits, out.slot_offsets, strict=True):
                if engine.read(offset) != block_bytes_of(key, BLOCK):
                    rec["corrupt"] += 1
            rec["loads"] += len(hits)
            engine.call("CompleteLoad", kvd_pb2.CompleteLoadRequest(keys=hits, req_id=seed,
                                                                    epoch=out.epoch))
        if rng.random() < 0.1:
            engine.call("RequestFinished", kvd_pb2.RequestFinishedRequest(req_id=seed))

    for _ in range(1_000_000):                  # bounded by the clock below
        if time.monotonic() > end:
            break
        rec["steps"] += 1
        started = time.monotonic()
        one_step()
        rec["slowest_step_s"] = max(rec["slowest_step_s"], time.monotonic() - started)
    engine.close()
    print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]),
                  float(sys.argv[5]) if len(sys.argv) > 5 else 0.0))
