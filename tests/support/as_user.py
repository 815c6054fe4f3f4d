"""A client process that drops to another uid/gid before it talks to the daemon.

`python -m tests.support.as_user UID GID SOCKET ACTION ARGS...` starts as root, imports
everything it needs (the interpreter and the checkout may not be readable by the target uid),
drops to UID/GID, then runs ACTION and prints one JSON line:

- `token`: ask for an admin token on the attach socket -> {"ok", "code"}
- `cli ARGS...`: run `kvd ARGS...` in-process -> {"rc", "stderr", "stdout"}
- `claim TENANT`: attach while claiming TENANT in the request -> {"ok", "tenant", "code"}
- `engine MODEL PREFIX N TAG`: look the keys up, try to load them, store them with TAG's bytes,
  read them back -> {"tenant", "states", "load_code", "stored", "cannot_store", "evicted",
  "own_match"}
- `verify MODEL PREFIX N TAG`: look the keys up and load them -> {"states", "match"}
"""

from __future__ import annotations

import contextlib
import fcntl  # noqa: F401  (the CLI's lazy imports, before the uid drop)
import hashlib
import io
import json
import os
import shutil  # noqa: F401  (argparse's terminal size, before the uid drop)
import socket
import struct
import sys

import grpc
from google.protobuf import json_format  # noqa: F401
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: F401  (before the uid drop)

import kvd_client.attach  # (everything imported before the uid drop)
import kvd_client.pool_map  # noqa: F401
from kvd_proto import attach as attach_protocol
from kvd_proto import kvd_pb2, kvd_pb2_grpc  # noqa: F401
from kvd_server.cli import main as cli
from kvd_server.rpc import admin_tokens  # noqa: F401
from tests.support.engine import Engine, keys_for

BLOCK = 64 * 1024


def tagged_bytes(key: bytes, tag: str) -> bytes:
    seed = hashlib.sha256(tag.encode() + b"/" + key).digest()
    return (seed * (BLOCK // len(seed) + 1))[:BLOCK]


def drop(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def attach_claiming(sock_path: str, tenant: str) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(sock_path + ".attach")
        s.sendall(json.dumps({"version": 1, "pid": os.getpid(), "role": "engine",
                              "tenant": tenant, "uid": 0}).encode() + b"\n")
        data, fds, _, _ = socket.recv_fds(s, 65536, 4)
        while len(data) < 4 + struct.unpack(">I", data[:4])[0]:
            data += s.recv(65536)
        for fd in fds:
            os.close(fd)
    return json.loads(data[4:])


def engine_action(sock_path: str, model: str, prefix: str, n: int, tag: str) -> dict:
    keys = keys_for(prefix, n)
    e = Engine(sock_path, model, block=BLOCK, engine_id=f"as-user-{os.getuid()}")
    try:
        states = list(e.lookup(keys).states)
        try:
            e.call("PrepareLoad", kvd_pb2.PrepareLoadRequest(keys=keys, req_id="x"))
            load_code = "OK"
        except grpc.RpcError as exc:
            load_code = exc.code().name
        grant = e.call("PrepareStore", kvd_pb2.PrepareStoreRequest(keys=keys, req_id="s"))
        for key, offset in zip(grant.keys_to_store, grant.slot_offsets):
            e.write(offset, tagged_bytes(key, tag))
        if grant.keys_to_store:
            e.call("CompleteStore", kvd_pb2.CompleteStoreRequest(
                keys=grant.keys_to_store, success=True, req_id="s", epoch=grant.epoch,
                slot_offsets=grant.slot_offsets))
        stored = list(grant.keys_to_store)
        ready = [k for k, s in zip(stored, e.lookup(stored).states)
                 if s == kvd_pb2.BLOCK_STATE_HIT]
        own = e.load(ready) if ready else []
        return {"tenant": e.info.tenant, "states": states, "load_code": load_code,
                "stored": len(stored), "cannot_store": grant.cannot_store,
                "evicted": len(grant.evicted_keys),
                "own_match": all(d == tagged_bytes(k, tag) for k, d in zip(ready, own))}
    finally:
        e.close()


def scan_action(sock_path: str, model: str, prefix: str, n: int, tag: str) -> dict:
    """Everything an engine of this tenant can do with its descriptor: look for another
    tenant's bytes (`tag`, keys `prefix`) anywhere in its mapping, then overwrite all of it."""
    from kvd_client.attach import attach
    from kvd_client.pool_map import PoolMapping

    info = attach(sock_path, role="dataplane")
    mapping = PoolMapping(info.fd, info.pool_bytes)
    try:
        view = mapping.view(0, info.pool_bytes)
        whole = bytes(view)
        found = sum(1 for key in keys_for(prefix, n) if tagged_bytes(key, tag)[:64] in whole)
        view[:] = b"\xff" * info.pool_bytes
        view.release()
        return {"tenant": info.tenant, "pool_bytes": info.pool_bytes, "found": found}
    finally:
        mapping.close()


def verify_action(sock_path: str, model: str, prefix: str, n: int, tag: str) -> dict:
    keys = keys_for(prefix, n)
    e = Engine(sock_path, model, block=BLOCK, engine_id=f"as-user-{os.getuid()}")
    try:
        states = list(e.lookup(keys).states)
        hits = [k for k, s in zip(keys, states) if s == kvd_pb2.BLOCK_STATE_HIT]
        data = e.load(hits) if hits else []
        return {"states": states, "match": all(d == tagged_bytes(k, tag)
                                               for k, d in zip(hits, data))}
    finally:
        e.close()


def main(argv: list[str]) -> int:
    uid, gid, sock_path, action, *rest = argv
    drop(int(uid), int(gid))
    if action == "token":
        try:
            attach_protocol.request_admin_token(sock_path, 5.0)
            out: dict = {"ok": True, "code": "OK"}
        except attach_protocol.AttachError as exc:
            out = {"ok": False, "code": exc.code, "error": str(exc)}
    elif action == "cli":
        err, printed = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(printed):
            rc = cli.main([*rest, "--socket", sock_path])
        out = {"rc": rc, "stderr": err.getvalue(), "stdout": printed.getvalue()}
    elif action == "claim":
        doc = attach_claiming(sock_path, rest[0])
        out = {"ok": doc.get("ok"), "tenant": doc.get("tenant"), "code": doc.get("code")}
    elif action in ("engine", "verify", "scan"):
        model, prefix, n, tag = rest[0], rest[1], int(rest[2]), rest[3]
        fn = {"engine": engine_action, "verify": verify_action, "scan": scan_action}[action]
        out = fn(sock_path, model, prefix, n, tag)
    else:
        raise SystemExit(f"unknown action {action}")
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
