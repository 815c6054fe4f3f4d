"""A misbehaving-but-honest engine for fault tests: stores, loads and leases in a loop until it
is killed. Every block it completes holds `block_bytes_of(key)`, so a reader can prove that no
block became visible before it was completely written.

Usage: python -m tests.fault.chaos SOCKET SEED
"""

from __future__ import annotations

import random
import sys

import grpc

from kvd_proto import kvd_pb2
from tests.support.engine import Engine, block_bytes_of, keys_for


def main(socket: str, seed: str) -> int:
    rng = random.Random(seed)
    engine = Engine(socket, "chaos-model", engine_id=f"chaos-{seed}")
    universe = keys_for("chaos", 64)       # shared by every chaos client: contention on purpose
    print("ready", flush=True)
    for _ in range(100_000):                # bounded; the test kills us long before
        keys = rng.sample(universe, rng.randint(1, 6))
        action = rng.random()
        if action < 0.5:
            grant = engine.call("PrepareStore", kvd_pb2.PrepareStoreRequest(keys=keys, req_id="c"))
            for key, offset in zip(grant.keys_to_store, grant.slot_offsets, strict=True):
                data = block_bytes_of(key, engine.block)
                half = len(data) // 2       # a kill between the halves leaves a torn block
                engine.write(offset, data[:half])
                engine.write(offset + half, data[half:])
            if grant.keys_to_store and rng.random() < 0.9:
                engine.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
                    keys=grant.keys_to_store, success=True, req_id="c", epoch=grant.epoch))
        elif action < 0.85:
            states = engine.lookup(keys, lease_ms=rng.choice([0, 500])).states
            hits = [k for k, s in zip(keys, states, strict=False) if s == kvd_pb2.BLOCK_STATE_HIT]
            if hits:
                try:
                    out = engine.call("PrepareLoad", kvd_pb2.PrepareLoadRequest(keys=hits))
                except grpc.RpcError:
                    continue                # evicted between lookup and load: fine
                for key, offset in zip(hits, out.slot_offsets, strict=True):
                    if engine.read(offset) != block_bytes_of(key, engine.block):
                        print(f"CORRUPT {key.hex()}", flush=True)
                        return 3
                if rng.random() < 0.8:
                    engine.call("CompleteLoad", kvd_pb2.CompleteLoadRequest(
                        keys=hits, epoch=out.epoch))
        else:
            engine.call("RequestFinished", kvd_pb2.RequestFinishedRequest(req_id="c"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
