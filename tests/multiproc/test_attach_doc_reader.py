"""docs/attach.md is what a client in another language writes its shared-index reader from, so
this test writes one from the page's words alone and points it at a real daemon.

The reader (`DocSpec`, `DocIndex`, `DocSession`) knows nothing the page does not say: the
header fields and their offsets, where each region lies, the meta word's bit fields, the home
bucket, the next bucket (so whether the probe wraps), the probe bound, where a slot's key lies,
the slot-to-offset formula and the order of the descriptors the index attach hands over are
all parsed out of docs/attach.md, so the page and the daemon cannot drift apart unnoticed. It
imports neither kvd_client nor kvd_proto's layout code (kvd_pb2 only: the wire contract a
client generates from kvd.proto); the tests use those only to cross-check.

Run as a module (`python -m tests.multiproc.test_attach_doc_reader store SOCKET MODEL
HEXKEY...`), this file is also a client process that stores keys over gRPC PrepareStore.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import json
import mmap
import operator
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvd_proto import kvd_pb2, kvd_pb2_grpc
from tests.support.heartbeat import keep_alive

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "attach.md"
TOKEN_METADATA = "kvd-session-token"          # docs/attach.md, first paragraph


# --- what the page says ----------------------------------------------------------------------


_OPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.floordiv,                   # the page: "`/` is integer division"
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.BitAnd: operator.and_}


def formula(text: str, names: Iterable[str]) -> Callable[..., int]:
    """A formula as the page writes it (`x` for times, multi-word names such as `key width`)
    as a function of keyword arguments; `crc32(...)` is zlib's CRC-32 (the page says so)."""
    expr = text.replace(" x ", " * ")
    for name in sorted(names, key=len, reverse=True):
        if " " in name:
            expr = expr.replace(name, name.replace(" ", "_"))
    tree = ast.parse(expr.strip(), mode="eval").body

    def ev(node: ast.AST, env: dict[str, Any]) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return env[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left, env), ev(node.right, env))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "crc32" and len(node.args) == 1:
            return zlib.crc32(ev(node.args[0], env))
        raise ValueError(f"the page's formula {text!r} uses {ast.dump(node)}")

    return lambda **env: ev(tree, env)


def _one(pattern: str, text: str, what: str) -> re.Match[str]:
    m = re.search(pattern, text)
    assert m, f"docs/attach.md does not say {what} (looked for {pattern!r})"
    return m


@dataclass
class DocSpec:
    """The shared index as docs/attach.md's "The shared index" section describes it."""

    magic: bytes
    magic_at: int
    fields: dict[str, tuple[str, int]]          # name (underscored) -> (struct code, offset)
    constants: dict[str, int]                   # fields the page gives a value: version, ...
    reclaim_start: int
    regions: dict[str, tuple[Callable[..., int], int]]   # name -> (at, rounded up to)
    key_at: Callable[..., int]
    bits: dict[str, tuple[int, int]]            # state / key length / generation -> (lo, hi)
    states: dict[str, int]                      # free / storing / ready -> value
    home: Callable[..., int]
    next_bucket: Callable[..., int]
    max_probe: int
    offset_of: Callable[..., int]
    index_first: bool                           # the index's descriptor comes before the marks'
    mark_code: str

    @classmethod
    def parse(cls, doc: str) -> DocSpec:
        section = doc.split("## The shared index", 1)[1].split("## The channel", 1)[0]
        flat = " ".join(section.split())
        rows = {m[1]: (m[2].strip(), m[3].strip()) for m in
                re.finditer(r"^\| (header|buckets|meta|keys) \| ([^|]+) \| ([^|]+) \|$",
                            section, re.M)}
        assert set(rows) == {"header", "buckets", "meta", "keys"}, sorted(rows)
        header = rows["header"][1]
        magic = _one(r"magic `(\w+)` @(\d+)", header, "the magic")
        fields: dict[str, tuple[str, int]] = {}
        constants: dict[str, int] = {}
        for kind, name, at, value in re.findall(
                r"\b(u32|u64) ([a-z_][a-z_ ]*?) @(\d+)(?: \((\d+)\))?", header):
            key = name.replace(" ", "_")
            fields[key] = ("<I" if kind == "u32" else "<Q", int(at))
            if value:
                constants[key] = int(value)
        names = [*fields, *(n.replace("_", " ") for n in fields), "meta", "keys", "buckets"]
        regions = {}
        for region in ("buckets", "meta", "keys"):
            at = rows[region][0]
            base, _, rounded = at.partition(", rounded up to ")
            regions[region] = (formula(base, names), int(rounded or 1))
        key_at = _one(r"slot s's at ([^)]+)\)", rows["keys"][1], "where a slot's key lies")
        meta_row = rows["meta"][1]
        bits = {name: (int(lo), int(hi)) for lo, hi, name in
                re.findall(r"bits (\d+)-(\d+) ([a-z][a-z ]*[a-z])", meta_row)}
        states = {name: int(v) for v, name in re.findall(r"(\d) (free|storing|ready)", meta_row)}
        _one(r"slot id \+ 1, or 0 \(empty\)", rows["buckets"][1], "what a bucket holds")
        _one(r"zlib's CRC-32, initial value 0", flat, "which CRC-32")
        _one(r"`/` is integer division", flat, "that `/` is integer division")
        order = _one(r"first the (index|marks file), then the (index|marks file)", flat,
                     "the order of the index attach's descriptors")
        _one(r"The marks file's first u64", flat, "where the mark lies")
        return cls(
            magic=magic[1].encode(), magic_at=int(magic[2]), fields=fields,
            constants=constants,
            reclaim_start=int(_one(r"reclaim epoch @\d+ \(starts at (\d+)\)", header,
                                   "where the reclaim epoch starts")[1]),
            regions=regions, key_at=formula(key_at[1], names), bits=bits, states=states,
            home=formula(_one(r"home bucket is `([^`]+)`", flat, "the home bucket")[1], names),
            next_bucket=formula(_one(r"the bucket after `b` is `([^`]+)`", flat,
                                     "which bucket comes next")[1], names),
            max_probe=int(_one(r"at most (\d+) buckets counting the home one", flat,
                               "how far a probe goes")[1]),
            offset_of=formula(_one(r"A slot id names a pool offset: `([^`]+)`", flat,
                                   "a slot's pool offset")[1], names),
            index_first=order[1] == "index", mark_code="<Q")


def spec() -> DocSpec:
    return DocSpec.parse(DOC.read_text())


# --- a reader written from it ----------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    state: int
    slot: int
    bucket: int
    word: int
    offset: int


class DocIndex:
    """A read-only mapping of one namespace's index, read as the page says."""

    def __init__(self, spec: DocSpec, index_fd: int, marks_fd: int) -> None:
        self.spec = spec
        size = os.fstat(index_fd).st_size
        self.map = mmap.mmap(index_fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        self.marks = mmap.mmap(marks_fd, 4096, mmap.MAP_SHARED,
                               mmap.PROT_READ | mmap.PROT_WRITE)
        self._mark = memoryview(self.marks)[0:8].cast("Q")
        self._fence = threading.Lock()
        s = spec
        if self.map[s.magic_at:s.magic_at + len(s.magic)] != s.magic:
            raise ValueError("not a kvd index: magic differs")
        h = self.header()
        for name, value in s.constants.items():
            if h[name] != value:
                raise ValueError(f"index {name} is {h[name]}, the page says {value}")
        env = dict(h)          # in the page's formulas `buckets` is the count, `meta` and
        self.at: dict[str, int] = {}            # `keys` the regions' places
        for region in ("buckets", "meta", "keys"):
            at, align = s.regions[region]
            self.at[region] = -(-at(**env) // align) * align
            if region != "buckets":
                env[region] = self.at[region]
        self.env = env
        end = s.key_at(s=h["capacity"], **env)
        if end > size:
            raise ValueError(f"index file of {size} bytes is shorter than its regions ({end})")

    def header(self) -> dict[str, int]:
        return {name: struct.unpack_from(code, self.map, at)[0]
                for name, (code, at) in self.spec.fields.items()}

    def field(self, name: str) -> int:
        code, at = self.spec.fields[name]
        return struct.unpack_from(code, self.map, at)[0]

    def bucket(self, b: int) -> int:
        return struct.unpack_from("<I", self.map, self.at["buckets"] + 4 * b)[0]

    def meta(self, slot: int) -> int:
        return struct.unpack_from("<Q", self.map, self.at["meta"] + 8 * slot)[0]

    def bits(self, word: int, name: str) -> int:
        lo, hi = self.spec.bits[name]
        return (word >> lo) & ((1 << (hi - lo + 1)) - 1)

    def home(self, key: bytes) -> int:
        return self.spec.home(key=key, **self.env)

    def offset(self, slot: int) -> int:
        return self.spec.offset_of(slot=slot, **self.env)

    def lookup(self, key: bytes) -> Found | None:
        """Probe as the page says; None: absent (or a miss the page allows)."""
        env, free = self.env, self.spec.states["free"]
        if len(key) > env["key_width"]:
            return None
        b = self.home(key)
        for _ in range(self.spec.max_probe):
            v = self.bucket(b)
            if v == 0:
                return None
            slot = v - 1
            if slot < env["capacity"]:
                word = self.meta(slot)
                if self.bits(word, "state") != free and self.bits(word, "key length") == len(key):
                    at = self.spec.key_at(s=slot, **env)
                    same = self.map[at:at + len(key)] == key
                    if same and self.meta(slot) == word:
                        return Found(self.bits(word, "state"), slot, b, word, self.offset(slot))
            b = self.spec.next_bucket(b=b, **env)
        return None

    def publish(self, epoch: int) -> None:
        """The mark: one 8-byte store, then the page's Python full barrier."""
        self._mark[0] = epoch
        self._fence.acquire()
        self._fence.release()

    def begin_step(self) -> int:
        """Rule 1: publish the reclaim epoch before the step's first index read."""
        epoch = self.field("reclaim_epoch")
        self.publish(epoch)
        return epoch

    def close(self) -> None:
        self._mark.release()
        self.marks.close()
        self.map.close()


def _recv_exact(sock: socket.socket, n: int, fds: list[int], firsts: list[int]) -> bytes:
    buf = b""
    while len(buf) < n:
        data, got, _, _ = socket.recv_fds(sock, n - len(buf), 4)
        firsts.append(len(got))
        fds += got
        if not data:
            raise ConnectionError("the daemon closed the attach connection early")
        buf += data
    return buf


def doc_attach(path: str, request: dict[str, Any]) -> tuple[dict[str, Any], list[int], bool]:
    """One attach exchange as the page's "Exchange" says: (answer, descriptors, whether they
    all came with the answer's first bytes)."""
    fds: list[int] = []
    firsts: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path + ".attach")
        sock.sendall(json.dumps(request).encode() + b"\n")
        (n,) = struct.unpack(">I", _recv_exact(sock, 4, fds, firsts))
        answer = json.loads(_recv_exact(sock, n, fds, firsts))
    return answer, fds, firsts[0] == len(fds)


class DocSession:
    """An engine session made from the page: attach, register, heartbeat, then the index."""

    def __init__(self, spec: DocSpec, path: str, model: str, block: int) -> None:
        self.path, self.block = path, block
        answer, fds, _ = doc_attach(path, {"version": 1, "role": "engine", "engine_id": "doc"})
        assert answer["ok"] and len(fds) == 1, answer
        self.token, self.pool_bytes = answer["token"], answer["pool_bytes"]
        self.pool = mmap.mmap(fds[0], self.pool_bytes, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fds[0])
        self.channel = grpc.insecure_channel(f"unix://{path}")
        self.stub = kvd_pb2_grpc.KvdEngineStub(self.channel)
        self.md = ((TOKEN_METADATA, self.token),)
        layout = kvd_pb2.KvLayout(block_bytes=block, num_ranks=1, shard_bytes=block,
                                  tokens_per_block=16, dtype="bfloat16")
        self.reg = self.stub.RegisterSession(kvd_pb2.RegisterSessionRequest(
            engine=kvd_pb2.EngineIdentity(engine_id="doc", engine_kind="pytest"), model=model,
            layout=layout), metadata=self.md, timeout=5)
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._heartbeat, daemon=True)
        self._beats.start()
        answer, fds, first = doc_attach(path, {"version": 1, "role": "index",
                                               "token": self.token})
        assert answer["ok"] and len(fds) == 2, answer
        self.index_answer, self.fds_with_first_bytes = answer, first
        index_fd, marks_fd = fds if spec.index_first else fds[::-1]
        self.index_bytes = os.fstat(index_fd).st_size
        try:
            self.index = DocIndex(spec, index_fd, marks_fd)
        finally:
            os.close(index_fd)
            os.close(marks_fd)

    def _heartbeat(self) -> None:
        keep_alive(self.stub, self.md, self._stop)

    def step(self, *ops: kvd_pb2.StepOp) -> list[Any]:
        out = self.stub.Step(kvd_pb2.StepRequest(ops=ops), metadata=self.md, timeout=5)
        return [getattr(r, r.WhichOneof("result")) for r in out.results]

    def read(self, offset: int) -> bytes:
        return self.pool[offset:offset + self.block]

    def write(self, offset: int, data: bytes) -> None:
        self.pool[offset:offset + len(data)] = data

    def close(self) -> None:
        """CloseSession before the stream closes (the page: else everything stays held)."""
        with contextlib.suppress(grpc.RpcError):
            self.stub.CloseSession(kvd_pb2.CloseSessionRequest(), metadata=self.md, timeout=5)
        self._stop.set()
        self._beats.join(timeout=5)
        self.channel.close()
        self.index.close()
        self.pool.close()


# --- the client process that stores over gRPC ------------------------------------------------


def _store_main(argv: list[str]) -> int:
    """`store SOCKET MODEL HEXKEY...`: PrepareStore, write, CompleteStore; prints the offsets."""
    from tests.support.engine import Engine

    _, sock, model, *hexkeys = argv
    engine = Engine(sock, model, engine_id=f"doc-store-{os.getpid()}")
    try:
        grant = engine.store([bytes.fromhex(k) for k in hexkeys])
        print(json.dumps({"keys": [k.hex() for k in grant.keys_to_store],
                          "offsets": list(grant.slot_offsets),
                          "cannot_store": grant.cannot_store}), flush=True)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(_store_main(sys.argv[1:]))


# --- the tests -------------------------------------------------------------------------------

import pytest  # noqa: E402  (the client process above needs no pytest)

from tests.support.daemon import PY, clean_env  # noqa: E402
from tests.support.engine import BLOCK, block_bytes_of, keys_for  # noqa: E402
from tests.support.offload_engine import EngineProcess, namespace  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402

pytestmark = pytest.mark.multiproc
MODEL = "doc-reader-model"
SOAK_S = float(os.environ.get("KVD_SOAK_LOAD_S", "20"))


def _keys_homed_at(index: DocIndex, bucket: int, n: int, tag: str) -> list[bytes]:
    """`n` keys of 20 bytes whose home bucket (the page's formula) is `bucket`."""
    out: list[bytes] = []
    i = 0
    while len(out) < n:
        key = f"{tag}/{i}".encode().ljust(20, b".")
        if index.home(key) == bucket:
            out.append(key)
        i += 1
    return out


def _grpc_store(sock: str, keys: list[bytes]) -> dict[bytes, int]:
    out = subprocess.run([PY, "-m", "tests.multiproc.test_attach_doc_reader", "store", sock,
                          MODEL, *(k.hex() for k in keys)], env=clean_env(),
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert not doc["cannot_store"] and len(doc["keys"]) == len(keys), doc
    return {bytes.fromhex(k): o for k, o in zip(doc["keys"], doc["offsets"], strict=True)}


def _fast_store(engine: EngineProcess, keys: list[bytes]) -> dict[bytes, int]:
    granted = engine.ask("store", keys)["granted"]
    assert len(granted) == len(keys), granted
    return {bytes.fromhex(k): o for k, o in granted}


def test_the_page_states_the_layout_kvd_proto_implements():
    """The parsed page against kvd_proto's layout (a cross-check, not the reader's source)."""
    from kvd_proto import index_layout as layout

    s = spec()
    assert s.magic == layout.MAGIC and s.constants["version"] == layout.VERSION
    assert s.constants["header_bytes"] == layout.HEADER_BYTES
    assert s.fields["reset_epoch"] == ("<Q", layout.RESET_EPOCH_OFFSET)
    assert s.fields["reclaim_epoch"] == ("<Q", layout.RECLAIM_EPOCH_OFFSET)
    assert s.reclaim_start == layout.FIRST_RECLAIM_EPOCH and s.max_probe == layout.MAX_PROBE
    assert s.states == {"free": layout.STATE_FREE, "storing": layout.STATE_STORING,
                        "ready": layout.STATE_READY}
    word = layout.meta_word(layout.STATE_READY, 17, 12345)
    for name, want in (("state", layout.STATE_READY), ("key length", 17), ("generation", 12345)):
        lo, hi = s.bits[name]
        assert (word >> lo) & ((1 << (hi - lo + 1)) - 1) == want, name
    h = layout.Header(capacity=1000, buckets=layout.buckets_for(1000), key_width=40,
                      per_extent=64, stride=65536, extent_bytes=4 << 20)
    env = {"capacity": h.capacity, "buckets": h.buckets, "key_width": h.key_width,
           "per_extent": h.per_extent, "stride": h.stride, "extent_bytes": h.extent_bytes}
    for region, want in (("buckets", h.buckets_offset), ("meta", h.meta_offset),
                         ("keys", h.keys_offset)):
        at, align = s.regions[region]
        assert -(-at(**env) // align) * align == want, region
        if region != "buckets":
            env[region] = want
    assert s.key_at(s=7, **env) == h.keys_offset + 7 * h.key_width
    assert [s.offset_of(slot=x, **env) for x in (0, 63, 64, 999)] == \
        [h.offset_of(x) for x in (0, 63, 64, 999)]
    assert s.home(key=b"k" * 20, **env) == layout.key_hash(b"k" * 20) % h.buckets
    assert s.next_bucket(b=h.buckets - 1, **env) == 0, "the page's probe does not wrap"


def test_a_reader_written_from_the_page_reads_the_daemons_index(daemon):
    s = spec()
    reader = DocSession(s, daemon.socket, MODEL, BLOCK)
    engine = EngineProcess(daemon.socket, MODEL, reserve=16)
    try:
        index = reader.index
        h = index.header()
        # The attach answer and the descriptors are as the page says.
        assert reader.index_answer["index_version"] == s.constants["version"]
        assert reader.index_answer["index_bytes"] == reader.index_bytes
        assert reader.fds_with_first_bytes, "the descriptors did not come with the first bytes"
        # Geometry and epochs: what the daemon reports.
        doc = daemon.stats()
        pool, ns = doc["pool"], namespace(doc, MODEL)
        assert h["stride"] == reader.reg.slot_bytes == ns["slot_bytes"]
        assert h["extent_bytes"] == pool["extent_bytes"]
        assert h["per_extent"] == pool["extent_bytes"] // h["stride"]
        assert h["capacity"] == pool["extents_total"] * h["per_extent"]
        assert h["buckets"] >= 2 * h["capacity"] and h["buckets"] & (h["buckets"] - 1) == 0
        from kvd_proto.wire import DEFAULT_INDEX_KEY_BYTES
        assert h["key_width"] == DEFAULT_INDEX_KEY_BYTES     # the proto: max_key_bytes 0 -> 64
        assert h["reset_epoch"] == reader.reg.epoch == ns["epoch"] == 0
        assert h["reclaim_epoch"] == s.reclaim_start
        from kvd_proto.index_layout import Header
        assert Header.unpack(index.map[:64]).geometry[:3] == \
            (index.at["buckets"], h["buckets"], index.at["meta"])

        # Keys that all start at the last bucket: their run wraps to bucket 0 and on.
        last = h["buckets"] - 1
        wrapping = _keys_homed_at(index, last, 8, "wrap")
        at_zero = _keys_homed_at(index, 0, 2, "zero")
        stored = _grpc_store(daemon.socket, keys_for("doc-grpc", 12) + wrapping[:3])
        stored |= _fast_store(engine, keys_for("doc-fast", 12) + wrapping[3:5] + at_zero)

        index.begin_step()
        wrapped = 0
        for key, offset in stored.items():
            found = index.lookup(key)
            assert found is not None, f"stored key {key.hex()} not found by the page's probe"
            assert found.state == s.states["ready"], (key.hex(), found)
            assert found.offset == offset, "the page's slot offset is not the daemon's"
            assert reader.read(found.offset) == block_bytes_of(key), key.hex()
            wrapped += found.bucket < index.home(key)
        assert wrapped >= 4, f"only {wrapped} keys were found past the wrap"
        absent = [*wrapping[5:], *keys_for("doc-never", 16), b"x" * (h["key_width"] + 1)]
        assert [index.lookup(k) for k in absent] == [None] * len(absent)

        # A store in flight is state 1 at its slot; completing it changes the state only.
        pending = keys_for("doc-pending", 1)
        (key_hex, offset), = engine.ask("reserve", pending)["granted"]
        engine.ask("settle")
        storing = index.lookup(pending[0])
        assert storing is not None and storing.state == s.states["storing"], storing
        assert storing.offset == offset
        engine.ask("complete", pending)
        engine.ask("settle")
        ready = wait_until(lambda: (f := index.lookup(pending[0])) and
                           f.state == s.states["ready"] and f, 10, "the store to be READY")
        assert (ready.slot, index.bits(ready.word, "generation")) == \
            (storing.slot, index.bits(storing.word, "generation"))

        # Grants survive a reset; the header's reset epoch is the epoch completions name;
        # bytes written before StoreGranted, StoreGranted and CompleteStore in one step.
        grant = reader.step(kvd_pb2.StepOp(grant=kvd_pb2.GrantRequest(count=1)))[0]
        (granted,) = grant.slot_offsets
        held = index.begin_step()
        slots = {k: index.lookup(k) for k in stored}
        reset = reader.stub.Reset(kvd_pb2.ResetRequest(), metadata=reader.md, timeout=5)
        assert index.field("reset_epoch") == reset.epoch == 1
        assert namespace(daemon.stats(), MODEL)["epoch"] == reset.epoch
        assert all(index.lookup(k) is None for k in stored), "a reset left a key indexed"
        for key, before in slots.items():
            word = index.meta(before.slot)
            assert index.bits(word, "state") == s.states["free"], key.hex()
            assert index.bits(word, "generation") == index.bits(before.word, "generation") + 1
        # This reader's mark holds what the reset freed: the daemon raises the reclaim epoch.
        wait_until(lambda: index.field("reclaim_epoch") > held, 10, "the reclaim epoch to rise")
        index.publish(0)                                    # rule 3: idle, holds nothing
        key = b"doc-after-reset".ljust(20, b".")
        reader.write(granted, block_bytes_of(key))
        done = reader.step(
            kvd_pb2.StepOp(store_granted=kvd_pb2.StoreGrantedRequest(
                keys=[key], granted_keys=[key], granted_offsets=[granted])),
            kvd_pb2.StepOp(complete_store=kvd_pb2.CompleteStoreRequest(
                keys=[key], success=True, epoch=index.field("reset_epoch"))))
        assert done[0].accepted == 1 and done[0].epoch == reset.epoch, done[0]
        assert done[1].completed == 1 and not done[1].ignored, done[1]
        index.begin_step()
        found = index.lookup(key)
        assert found is not None and found.state == s.states["ready"]
        assert found.offset == granted and reader.read(granted) == block_bytes_of(key)
        index.publish(0)
    finally:
        engine.close()
        reader.close()


def _churn_while_reading(start_daemon, seconds: float) -> None:
    """A fast-path engine stores batches of new keys into a 128-slot pool (evicting all the
    time) while the page's reader looks the latest ones up and copies every HIT under its
    published mark: every copy must be its key's bytes."""
    daemon = start_daemon("--pool-size", "8MiB", "--extent-size", "2MiB")
    s = spec()
    reader = DocSession(s, daemon.socket, MODEL, BLOCK)
    writer = EngineProcess(daemon.socket, MODEL, reserve=32)
    recent: collections.deque[bytes] = collections.deque(maxlen=256)
    stop = threading.Event()
    failed: list[BaseException] = []

    def churn() -> None:
        try:
            i = 0
            while not stop.is_set():
                batch = keys_for(f"churn-{i}", 16)
                writer.ask("store", batch)
                recent.extend(batch)
                i += 1
        except BaseException as exc:  # noqa: BLE001 - the test fails with it below
            failed.append(exc)

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    hits = misses = 0
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not failed:
            keys = list(recent)
            reader.index.begin_step()
            copies = []
            for key in keys:
                found = reader.index.lookup(key)
                if found is not None and found.state == s.states["ready"]:
                    copies.append((key, reader.read(found.offset)))
                else:
                    misses += 1
            reader.index.publish(0)                         # no load in flight
            bad = [k.hex() for k, data in copies if data != block_bytes_of(k)]
            assert not bad, f"the page's reader copied another key's bytes for {bad[:4]}"
            hits += len(copies)
            time.sleep(0.001)
    finally:
        stop.set()
        thread.join(timeout=60)
        writer.close()
        reader.close()
    assert not failed, failed
    assert hits > 100 and misses > 0, (hits, misses)
    assert namespace(daemon.stats(), MODEL)["evictions_total"] > 0, "nothing was evicted"


def test_the_page_reader_copies_only_its_keys_bytes_while_stores_evict(start_daemon):
    _churn_while_reading(start_daemon, 3.0)


@pytest.mark.soak
def test_the_page_reader_copies_only_its_keys_bytes_while_stores_evict_soak(start_daemon):
    """`KVD_SOAK_LOAD_S` seconds (60 in `make soak`)."""
    _churn_while_reading(start_daemon, SOAK_S)
