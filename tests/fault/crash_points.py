"""An engine process that stops at a named point of its work and waits to be killed or stopped.

The fault tests start it, wait for its one JSON line (`{"at": PHASE, ...}`), then SIGKILL or
SIGSTOP it there: mid-store (slots reserved, half written), mid-load (blocks pinned), holding
leases, between steps (nothing held), attached but never registered, or as a real `KvdClient`
holding pins, leases and a pending store through its heartbeat stream. The `stale_writer`
phase goes on after a line on stdin and writes the rest of its reserved slot: a stalled engine
that resumes after its session was reaped.

Usage: python -m tests.fault.crash_points SOCKET PHASE SEED
"""

from __future__ import annotations

import json
import os
import sys
import time

from kvd_proto import kvd_pb2
from tests.support.engine import BLOCK, Engine, block_bytes_of, keys_for

MODEL = "crash-model"
READY_SEED = "crash-ready"        # the test stores these 8 keys before starting the victim
READY_N = 8
PHASES = ("mid_store", "mid_load", "leases", "between_steps", "unregistered", "client")
HOLD_S = 60.0                     # bounded: the test kills us long before


def new_keys(seed: str, n: int = 4) -> list[bytes]:
    return keys_for(f"crash-new-{seed}", n)


def _say(doc: dict) -> None:
    print(json.dumps(doc), flush=True)


def _client_phase(socket: str, seed: str) -> None:
    """A real KvdClient (heartbeat stream, batched steps) holding pins, leases and a store."""
    from kvd_client.client import KvdClient
    from kvd_proto.wire import KvLayout

    client = KvdClient(socket, model=MODEL, engine_id=f"crash-client-{seed}",
                       layout=KvLayout(BLOCK, 1, BLOCK, 16, "bfloat16"), deadline_s=2.0)
    if not client.wait_available(10):
        raise SystemExit("client never connected")
    ready = keys_for(READY_SEED, READY_N)
    new = new_keys(seed)
    res = client.step([
        kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(keys=ready[6:8], lease_ms=30_000)),
        kvd_pb2.StepOp(prepare_load=kvd_pb2.PrepareLoadRequest(keys=ready[4:6], req_id="q")),
        kvd_pb2.StepOp(prepare_store=kvd_pb2.PrepareStoreRequest(keys=new, req_id="q")),
    ])
    if res is None:
        raise SystemExit("step failed")
    grant = res[2].prepare_store
    assert client.pool is not None
    for key, offset in zip(grant.keys_to_store, grant.slot_offsets, strict=True):
        view = client.pool.view(offset, BLOCK // 2)
        view[:] = block_bytes_of(key, BLOCK)[: BLOCK // 2]
        view.release()
    _say({"at": "client", "pins": 2, "leases": 2, "storing": len(grant.keys_to_store),
          "offsets": list(grant.slot_offsets)})
    time.sleep(HOLD_S)


def main(socket: str, phase: str, seed: str) -> int:
    if phase == "client":
        _client_phase(socket, seed)
        return 0
    registered = phase != "unregistered"
    engine = Engine(socket, MODEL, engine_id=f"crash-{phase}-{os.getpid()}",
                    register=registered, heartbeat=registered)
    ready = keys_for(READY_SEED, READY_N)
    new = new_keys(seed)
    doc: dict = {"at": phase, "pins": 0, "leases": 0, "storing": 0, "offsets": []}
    if phase in ("mid_store", "stale_writer"):
        keys = new if phase == "mid_store" else new[:1]
        grant = engine.call("PrepareStore", kvd_pb2.PrepareStoreRequest(keys=keys, req_id="w"))
        for key, offset in zip(grant.keys_to_store, grant.slot_offsets, strict=True):
            engine.write(offset, block_bytes_of(key, engine.block)[: engine.block // 2])
        doc.update(storing=len(grant.keys_to_store), offsets=list(grant.slot_offsets))
        if phase == "stale_writer":
            _say(doc)
            sys.stdin.readline()          # resumed after its session was reaped
            for offset in grant.slot_offsets:
                engine.write(offset + engine.block // 2,
                             b"\xee" * (engine.block - engine.block // 2))
            _say({"done": True})
            time.sleep(HOLD_S)
            return 0
    elif phase == "mid_load":
        out = engine.call("PrepareLoad", kvd_pb2.PrepareLoadRequest(keys=ready[:4], req_id="l"))
        for offset in out.slot_offsets:
            engine.read(offset)
        doc.update(pins=4, offsets=list(out.slot_offsets))
    elif phase == "leases":
        states = engine.lookup(ready, lease_ms=30_000).states
        doc.update(leases=sum(s == kvd_pb2.BLOCK_STATE_HIT for s in states))
    elif phase == "between_steps":
        engine.store(new)
        engine.load(ready[:2])
        engine.call("RequestFinished", kvd_pb2.RequestFinishedRequest(req_id="r"))
    elif phase != "unregistered":
        raise SystemExit(f"unknown phase {phase}")
    _say(doc)
    time.sleep(HOLD_S)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3]))
