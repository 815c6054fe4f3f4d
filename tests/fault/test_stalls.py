"""Engines that stall past the liveness timeout, and clients whose daemon goes away mid-copy:
no byte a client loads comes from a slot reused after it pinned it, what a stalled process
holds comes back once it is gone or says so, and a mapping in use stays valid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from kvd_proto import kvd_pb2
from kvd_proto.wire import KvLayout
from tests.support.daemon import PY, ROOT, clean_env
from tests.support.engine import BLOCK, Engine, block_bytes_of, keys_for
from tests.support.processes import readline_within, reap
from tests.support.summary import record
from tests.support.waits import wait_until

pytestmark = [pytest.mark.fault, pytest.mark.multiproc]
MODEL = "stall-model"
ROUNDS = max(1, int(os.environ.get("KVD_SOAK_ROUNDS", "10")) // 10)   # 10 in `make soak`

READER = r"""
import json, sys
from kvd_proto import kvd_pb2
from tests.support.engine import Engine
socket, model, key_hex = sys.argv[1:4]
e = Engine(socket, model, engine_id="stalled-reader")
key = bytes.fromhex(key_hex)
out = e.call("PrepareLoad", kvd_pb2.PrepareLoadRequest(keys=[key], req_id="r"))
print(json.dumps({"offset": out.slot_offsets[0]}), flush=True)
sys.stdin.readline()                       # stopped here; the test resumes us
data = e.read(out.slot_offsets[0])
print(json.dumps({"data": data.hex()}), flush=True)
"""


RELEASER = r"""
import json, sys
from kvd_proto import kvd_pb2
from tests.support.engine import Engine
socket, model, session_id = sys.argv[1:4]
e = Engine(socket, model, engine_id="not-the-owner")
out = e.call("ReleaseHeld", kvd_pb2.ReleaseHeldRequest(session_id=session_id))
print(json.dumps({"pins": out.released_pins, "slots": out.released_slots}))
e.close()
"""


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_reader_stalled_past_liveness_never_reads_a_reused_slot(daemon, round_):
    keys = keys_for(f"stall-pinned-{round_}", 1)
    writer = Engine(daemon.socket, MODEL, engine_id="writer")
    reader = subprocess.Popen([PY, "-c", READER, daemon.socket, MODEL, keys[0].hex()],
                              env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        writer.store(keys)
        offset = json.loads(readline_within(reader, 30))["offset"]
        os.kill(reader.pid, signal.SIGSTOP)
        wait_until(lambda: daemon.stats()["clients"]["reaped_total"] >= 1, 10,
                   "the stalled reader's session to be reaped")
        assert daemon.stats()["pool"]["quarantined_pins"] == 1
        # Fill the whole pool with other keys, over and over: the pinned block stays.
        for fill in range(3):
            others = keys_for(f"stall-fill-{round_}-{fill}", 1024)
            for i in range(0, 1024, 256):
                grant = writer.store(others[i:i + 256])
                assert offset not in grant.slot_offsets, "a slot a stalled reader pinned was reused"
        os.kill(reader.pid, signal.SIGCONT)
        assert reader.stdin is not None
        reader.stdin.write("go\n")
        reader.stdin.flush()
        data = bytes.fromhex(json.loads(readline_within(reader, 30))["data"])
        record("stall checks")
        assert data == block_bytes_of(keys[0]), "the stalled reader read another key's bytes"
        reap(reader, close=False)
        wait_until(lambda: daemon.stats()["pool"]["quarantined_pins"] == 0, 10,
                   "the stalled reader's pin to come back once it is gone")
        assert daemon.stats()["blocks"]["pinned"] == 0
    finally:
        reap(reader)
        writer.close()
    assert "Traceback" not in daemon.log()


def test_what_a_degraded_session_held_comes_back_when_its_process_says_so(daemon):
    from kvd_client.client import KvdClient

    ready = keys_for("held-ready", 4)
    writer = Engine(daemon.socket, MODEL, engine_id="writer")
    writer.store(ready)
    client = KvdClient(daemon.socket, model=MODEL, layout=KvLayout(BLOCK, 1, BLOCK, 16, "bfloat16"),
                       deadline_s=0.5)
    try:
        assert client.wait_available(10)
        res = client.step([kvd_pb2.StepOp(prepare_load=kvd_pb2.PrepareLoadRequest(
            keys=ready, req_id="q")), kvd_pb2.StepOp(prepare_store=kvd_pb2.PrepareStoreRequest(
                keys=keys_for("held-new", 2), req_id="q"))])
        assert res is not None
        first = client.session_id
        os.kill(daemon.proc.pid, signal.SIGSTOP)          # the client degrades ...
        try:
            wait_until(lambda: not client.available, 5, "the client to degrade")
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        wait_until(lambda: client.wait_available(1), 10, "the client to reconnect")   # ... and comes back
        assert client.previous_session_id == first
        wait_until(lambda: daemon.stats()["pool"]["quarantined_pins"] == 4, 10,
                   "the old session's pins to be held (its process lives on)")
        assert daemon.stats()["pool"]["quarantined_slots"] == 2
        # Another process cannot release them ...
        other = subprocess.run([PY, "-c", RELEASER, daemon.socket, MODEL, first],
                               env=clean_env(), capture_output=True, text=True, timeout=30,
                               cwd=ROOT)
        assert other.returncode == 0, other.stderr
        assert json.loads(other.stdout) == {"pins": 0, "slots": 0}
        assert daemon.stats()["pool"]["quarantined_pins"] == 4
        # ... this one can, once its copies are done.
        client.release_held(first)
        assert client.flush()
        doc = daemon.stats()
        assert doc["pool"]["quarantined_pins"] == 0 and doc["pool"]["quarantined_slots"] == 0
        assert doc["blocks"]["pinned"] == 0 and doc["blocks"]["storing"] == 0
        record("stall checks")
    finally:
        client.close()
        writer.close()


def test_a_mapping_in_use_stays_valid_when_the_daemon_goes_away(start_daemon, workdir):
    from kvd_client.client import KvdClient

    args = ("--pool-size", "16MiB", "--extent-size", "4MiB")
    daemon = start_daemon(*args)
    client = KvdClient(daemon.socket, model=MODEL, layout=KvLayout(BLOCK, 1, BLOCK, 16, "bfloat16"),
                       deadline_s=0.5)
    try:
        assert client.wait_available(10)
        res = client.step([kvd_pb2.StepOp(prepare_store=kvd_pb2.PrepareStoreRequest(
            keys=keys_for("mapped", 1), req_id="q"))])
        assert res is not None
        offset = res[0].prepare_store.slot_offsets[0]
        pool = client.pool
        assert pool is not None
        view = pool.view(offset, BLOCK)                   # an engine thread mid-copy
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(10)
        wait_until(lambda: not client.available, 5, "the client to notice")
        assert client.pool is pool                        # never None under a user
        view[:] = block_bytes_of(keys_for("mapped", 1)[0])
        again = start_daemon(*args)
        assert again.socket == daemon.socket
        wait_until(lambda: client.wait_available(1), 10, "the client to reconnect")
        assert client.pool is not pool
        view[:8] = b"still ok"                            # the old mapping still works
        view.release()
        record("stall checks")
    finally:
        client.close()
        time.sleep(0)
