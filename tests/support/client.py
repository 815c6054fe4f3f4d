"""The client program tests start as separate processes (`python -m tests.support.client
ACTION SOCKET MODEL SEED N`): an engine that stores, loads, or hangs holding pins and stores
until it is killed; and the helpers that run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from kvd_proto import kvd_pb2
from tests.support.daemon import PY, ROOT, clean_env
from tests.support.engine import Engine, block_bytes_of, keys_for


def run_client(socket: str, action: str, *args: str,
               timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run this file as a client process to completion; its stdout is one JSON line."""
    return subprocess.run([PY, "-m", "tests.support.client", action, socket, *args],
                          env=clean_env(), capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def start_client(socket: str, action: str, *args: str) -> subprocess.Popen[str]:
    """Start a client process that announces itself with one JSON line and stays alive."""
    return subprocess.Popen([PY, "-m", "tests.support.client", action, socket, *args],
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)


def _client_main(argv: Sequence[str]) -> int:
    """Client program: `store|load|hang SOCKET MODEL SEED N`."""
    action, socket, model, seed, n = argv[0], argv[1], argv[2], argv[3], int(argv[4])
    keys = keys_for(seed, n)
    # The "hang" client sends no heartbeats: its session must end by the liveness timeout.
    engine = Engine(socket, model, engine_id=f"client-{action}-{os.getpid()}",
                    heartbeat=action != "hang")
    if action == "store":
        grant = engine.store(keys)
        print(json.dumps({"stored": len(grant.keys_to_store),
                          "offsets": list(grant.slot_offsets),
                          "cannot_store": grant.cannot_store}), flush=True)
    elif action == "load":
        states = list(engine.lookup(keys).states)
        ok = all(s == kvd_pb2.BLOCK_STATE_HIT for s in states)
        data = engine.load(keys) if ok else []
        match = ok and all(d == block_bytes_of(k) for k, d in zip(keys, data, strict=True))
        print(json.dumps({"states": states, "match": match}), flush=True)
    elif action == "hang":
        # Half the keys are ready blocks (stored earlier by someone else): pin them; reserve the
        # other half for a store, write half a block into each slot, then wait to be killed.
        ready, new = keys[: n // 2], keys[n // 2:]
        pinned = engine.call("PrepareLoad", kvd_pb2.PrepareLoadRequest(keys=ready, req_id="h"))
        grant = engine.store(new, complete=False)
        for offset in grant.slot_offsets:
            engine.write(offset, b"\xee" * (engine.block // 2))
        print(json.dumps({"pinned": len(pinned.slot_offsets),
                          "storing": len(grant.keys_to_store)}), flush=True)
        time.sleep(120)  # bounded: the test kills it long before
    else:
        raise SystemExit(f"unknown action {action}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(_client_main(sys.argv[1:]))
