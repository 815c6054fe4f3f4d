"""The local disk tier (kvd_server/tiers/disk/tier.py, joined to the daemon by tiers/link.py) through
a real daemon: demotion and promotion bandwidth against the raw drive, what it adds to an
engine's hits, and what it costs the pool's hot path. Everything in one run, each daemon with
the defaults a user gets except the pool's size and `[tiers.disk]` path and size.

- `bandwidth`, per block size (64 KiB, 256 KiB, 2 MiB):
  - `raw`: a preallocated file in the directory the tier then uses, written and read back with
    O_DIRECT (buffered where the filesystem refuses it, e.g. tmpfs: `direct_io` says which) by
    a thread pool of os.pwritev / os.preadv, one request per block, at the tier's default
    depth (io_threads = 4) and in the order the tier lays blocks out (consecutive slots), two
    ways: from and into a memfd the pool's size, block after block (`write`, `read`: as much
    memory as the tier's bytes come from and land in, the like-for-like reference the goal is
    measured against), and from and into io_threads buffers used again and again
    (`reused_write`, `reused_read`: what fio or a plain O_DIRECT copier measures). On a VM
    whose virtual disk copies every transfer into guest memory on the host they differ (memory
    hot in the host's caches moves faster: 10-50% at 64-256 KiB measured here, mostly reads);
    a drive that moves memory by DMA does not care. Both ratios are reported. A shared
    machine's drive and CPUs drift by tens of percent from one minute to the next, so each
    size runs ROUNDS rounds of a raw pass, the tier's run at once after it and another raw
    pass at once after that; the tier is compared with the mean of the two raw passes around
    it (`bracketed`), and the round with the median tier/raw ratio is reported (each way on
    its own; every round's figures are kept under `rounds`).
  - `demotion`: an engine (OffloadSession over KvdClient, layout block bytes = the block size;
    a 64 MiB pool over a 512 MiB tier, --quick 32 MiB and 3x over 256 MiB) fills the pool
    (untimed: nothing is evicted yet, so the tier has nothing to do), then stores 4x what the
    pool holds, so every store evicts and the tier writes what the pool evicts: the steady
    state of a full pool. `wall_gb_per_s` = demoted_bytes_total / (first timed store until
    every record was read and the tier's queue is empty); `io_thread_gb_per_s` =
    demoted_bytes_total / (write_seconds_total / io_threads): what the I/O threads move while
    they are busy (the daemon's `kvd stats --json` "tiers" entry, read through
    KvdAdmin.Stats). Each as a fraction of raw.
  - `promotion`: the demoted keys read back through lookups as a scheduler with a queue of
    waiting requests does: requests of an eighth of the pool's blocks each, PROMOTE_IN_FLIGHT of them
    looked up every step (HIT_PENDING, step, again until HIT; then a pin and its unpin, and
    the next request joins), so the drive is not left idle while one request's answers travel;
    timed from the first lookup to the last request's HITs; the same two figures from
    promoted_bytes_total and read_seconds_total.
  - `daemon_cpu_s_per_gb`: the daemon process's CPU (utime + stime of /proc/PID/stat, every
    thread) over the phase, per GB demoted or promoted.
- `hit_rate`: a multi-turn chat trace (bench/traces.py's chat/medium, --quick chat/small; keys
  chained per 16-token block, 64 KiB blocks) replayed through an OffloadSession as vLLM's
  scheduler drives it, with no model time between steps (look the blocks up in prefix order up
  to the first miss, HIT_PENDING counting in as vLLM's scan does, stepping while one is
  HIT_PENDING for at most PENDING_WAIT_S, load the
  hits, store the rest), against a 32 MiB pool (512 blocks: far too small for the working set)
  and no tier, then the same pool over a 320 MiB disk tier (10x the pool): hit blocks and the
  gain.
- `lookup`: the scheduler-side time of OffloadSession.lookup per key, for keys in the pool and
  keys held nowhere (which a tier's "held below" table is also asked about), on both of those
  daemons in alternating rounds, the tier's daemon with its tier open and holding blocks.

The cluster tier (the same machinery over a Mooncake store) has its own bench,
bench/cluster_tier.py (promotion across two daemons against Mooncake's own put/get, and the
hits when sessions move between daemons); `make bench` runs both.

Run: `python bench/tiers.py [--quick] [--dir DIR]` (default: a new directory under /var/tmp,
a real disk where /tmp is tmpfs); it writes `tiers` into bench/results/latest.json (the other
keys kept) and its section of bench/README.md. `make bench` runs it after run_all.py.
"""

from __future__ import annotations

import argparse
import collections
import errno
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import grpc  # noqa: E402
from daemon import start_daemon  # noqa: E402
from report import _fill  # noqa: E402
from run_all import commit, machine  # noqa: E402
from traces import block_keys, generate  # noqa: E402

from kvd_client.client import KvdClient  # noqa: E402
from kvd_client.offload.session import Lookup, OffloadSession  # noqa: E402
from kvd_proto import kvd_pb2, kvd_pb2_grpc  # noqa: E402
from kvd_proto.paths import grpc_target  # noqa: E402
from kvd_proto.wire import KvLayout  # noqa: E402
from kvd_server.tiers.disk.files import open_data  # noqa: E402
from kvd_server.tiers.disk.tier import DATA_FILE, DEFAULT_IO_THREADS, DEFAULT_QUEUE_BYTES  # noqa: E402

RESULTS = HERE / "results"
MIB = 1 << 20
SIZES = (64 << 10, 256 << 10, 2 << 20)
IO_THREADS = DEFAULT_IO_THREADS          # the tier's default depth, the raw bench's too
RAW_RUNS = 3
ROUNDS = 5               # raw pass, tier, raw pass, per block size: the median round is reported
# bandwidth: (pool MiB, stored / pool, disk MiB); --quick: smaller
BW_FULL = (64, 4, 512)
BW_QUICK = (32, 3, 256)
# hit rate: a pool too small for the trace, a disk 10x the pool
HR_POOL_MIB = 32
HR_DISK_MIB = 320
HR_BLOCK = 64 << 10
HR_TOKENS_PER_BLOCK = 16
HR_TRACE = ("chat", "medium")  # 8,680 distinct blocks: 17x the pool, 1.7x the disk
HR_TRACE_QUICK = ("chat", "small")
STEP_BLOCKS = 2048 // HR_TOKENS_PER_BLOCK   # vLLM's max_num_batched_tokens per step, in blocks
PENDING_WAIT_S = 2.0     # a request waits this long for HIT_PENDING blocks, then goes without
STALL_S = 10.0           # bound on waiting for the reserve, the daemon, the tier's queue
PROMOTE_IN_FLIGHT = 4    # read-back requests looked up at once (an eighth of the pool each)
LOOKUP_KEYS = 128         # a quarter of the 512-block pool: its reserve refills never take them
LOOKUP_ROUNDS = 40
LOOKUP_TRIES = 5          # a round whose hot keys did not all read HIT is made again
GOAL = 0.8               # the goal: the tier moves >= 80% of raw, both ways


# --------------------------------------------------------------------------- helpers
def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (every thread), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def filesystem(path: Path) -> str:
    """The type of the filesystem `path` lies on (/proc/mounts, longest mount point)."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and \
                        len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


class Daemon:
    """A `kvd serve` started as the other benches start it (bench/daemon.py), with a config
    file for its `[tiers.disk]` (none: no tier); stats through KvdAdmin.Stats (the document
    `kvd stats --json` prints)."""

    def __init__(self, workdir: Path, pool_mib: int, disk: Path | None = None,
                 disk_mib: int = 0, toml: str = "") -> None:
        """`toml`: another tier's configuration (bench/cluster_tier.py: [tiers.cluster])."""
        workdir.mkdir(parents=True, exist_ok=True)
        extra: list[str] = []
        if disk is not None:
            toml = f'[tiers.disk]\npath = "{disk}"\nsize = "{disk_mib}MiB"\n'
        if toml:
            cfg = workdir / "kvd.toml"
            cfg.write_text(toml)
            extra = ["--config", str(cfg)]
        # The pool pre-faulted, as a user's is (pool.prefault's default).
        self.proc, self.socket = start_daemon(str(workdir), f"{pool_mib}MiB", *extra,
                                              prefault=True)
        self.channel = grpc.insecure_channel(grpc_target(self.socket))
        self.admin = kvd_pb2_grpc.KvdAdminStub(self.channel)
        if toml:
            self.wait(lambda: self.tier()["health"] == "ok", "the tier to open")

    def stats(self) -> dict:
        return json.loads(self.admin.Stats(kvd_pb2.StatsRequest(), timeout=10).json)

    def tier(self) -> dict:
        (tier,) = self.stats()["tiers"]
        return tier

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def wait(self, done, what: str, poll: float = 0.01) -> None:  # noqa: ANN001
        deadline = time.monotonic() + 60
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(poll)

    def close(self) -> None:
        self.channel.close()
        self.proc.terminate()
        self.proc.wait(30)


def open_session(socket: str, block: int, model: str) -> OffloadSession:
    """An engine's OffloadSession with the defaults (as tests/support/offload_engine.py)."""
    layout = KvLayout(block, 1, block, HR_TOKENS_PER_BLOCK, "bfloat16")
    client = KvdClient(socket, model=model, layout=layout, engine_id=f"bench-tiers-{os.getpid()}",
                       engine_kind="bench")
    session = OffloadSession(client)
    if not client.wait_available(30):
        raise RuntimeError(f"the engine did not connect to {socket}")
    session.lookup(b"\0")            # the first step adopts the index
    session.end_step()
    return session


def close_session(session: OffloadSession) -> None:
    session.close()
    session.client.close()


def settle(session: OffloadSession) -> None:
    """End the step and step until the daemon has read and answered everything sent."""
    session.end_step()
    deadline = time.monotonic() + STALL_S * 3
    while session.has_pending_work():
        if time.monotonic() > deadline:
            raise RuntimeError("the daemon did not read the engine's records")
        time.sleep(0.0005)
        session.end_step()


def store(session: OffloadSession, keys: list[bytes], payload: bytes | None = None,
          req_id: str = "") -> bool:
    """Store `keys` as an engine does: slots from the reserve (stepping while it is short),
    the bytes written (`payload`; None: left as they are), complete, end the step. False when
    the reserve stayed short for STALL_S."""
    deadline = time.monotonic() + STALL_S
    while True:
        granted = session.store_slots(keys, req_id)
        if granted is not None:
            break
        session.end_step()
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    new, offsets = granted
    if payload is not None:
        pool = session.client.pool
        for offset in offsets:
            view = pool.view(offset, len(payload))
            view[:] = payload
            view.release()
    if new:
        session.complete_store(new, req_id)
    session.end_step()
    return True


def keys_for(seed: str, n: int) -> list[bytes]:
    import hashlib

    return [hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=16).digest() for i in range(n)]


# --------------------------------------------------------------------------- 1. raw
def _memory(nbytes: int, shared: bool) -> mmap.mmap:
    """Page-aligned memory for the raw passes, every page touched (filled with random bytes):
    `shared`, a memfd mapped shared, as the daemon's pool is."""
    if shared:
        fd = os.memfd_create("kvd-raw-bench", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            mem = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
    else:
        mem = mmap.mmap(-1, nbytes)
    chunk = os.urandom(1 << 20)
    for at in range(0, nbytes, len(chunk)):
        mem[at:at + min(len(chunk), nbytes - at)] = chunk[:nbytes - at]
    return mem


def _raw_pass(fd: int, write: bool, block: int, n: int, memory: mmap.mmap) -> float:
    """n requests of `block` bytes at consecutive offsets, IO_THREADS in flight, the i-th
    from or into the i-th block-sized slot of `memory` (cycling): seconds."""
    slots = len(memory) // block
    view = memoryview(memory)

    def one(i: int) -> None:
        at = i % slots * block
        buf = view[at:at + block]
        try:
            done = os.pwritev(fd, [buf], i * block) if write else \
                os.preadv(fd, [buf], i * block)
        finally:
            buf.release()
        if done != block:
            raise OSError(errno.EIO, f"short {'write' if write else 'read'}: {done}")

    try:
        with ThreadPoolExecutor(IO_THREADS) as pool:
            t0 = time.perf_counter()
            for f in [pool.submit(one, i) for i in range(n)]:   # one request per block
                f.result()
            return time.perf_counter() - t0
    finally:
        view.release()


def raw(directory: Path, block: int, moved: int, file_bytes: int, runs: int = RAW_RUNS, *,
        pool_bytes: int) -> dict:
    """O_DIRECT write then read bandwidth of `moved` bytes in `directory` (median of
    `runs`), two ways (see the module doc): (`write`, `read`) from and into a memfd of
    `pool_bytes`, slot after slot, as the promotions' reads land in the pool (the demotions'
    writes come from the tier's own buffers, up to its queue's worth); (`reused_write`,
    `reused_read`) from and into IO_THREADS buffers used again and again, as fio does."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "kvd-raw-bench.data"
    n = moved // block
    out: dict = {"bytes": n * block, "pool_bytes": pool_bytes}
    ways = {"": pool_bytes, "reused_": IO_THREADS * block}
    for prefix in ways:
        for op in ("write", "read"):
            out[prefix + op] = {"runs_seconds": []}
    mems = {prefix: _memory(size, shared=not prefix) for prefix, size in ways.items()}
    try:
        for _ in range(runs):
            for prefix, mem in mems.items():
                fd, direct = open_data(str(path), file_bytes)   # fresh, as the tier's file is
                try:
                    for op in ("write", "read"):
                        out[prefix + op]["runs_seconds"].append(
                            _raw_pass(fd, op == "write", block, n, mem))
                finally:
                    os.close(fd)
                    path.unlink()
    finally:
        path.unlink(missing_ok=True)
        for mem in mems.values():
            mem.close()
    out["direct_io"] = direct
    for prefix in ways:
        for op in ("write", "read"):
            secs = statistics.median(out[prefix + op]["runs_seconds"])
            out[prefix + op].update(seconds=secs, gb_per_s=n * block / secs / 1e9)
    return out


# --------------------------------------------------------------------------- 2. the tier
def demote_promote(workdir: Path, block: int, pool_mib: int, times: int, disk_mib: int) -> dict:
    """Store `times` x the pool through a real daemon with a disk tier, then read back what was
    demoted (see the module doc)."""
    disk = workdir / "disk"
    d = Daemon(workdir, pool_mib, disk, disk_mib)
    session = open_session(d.socket, block, f"bench-tiers-{block}")
    try:
        capacity = session.capacity
        keys = keys_for(f"bw-{block}", capacity * (times + 1))
        payload = os.urandom(4096) * (block // 4096)
        batch = max(1, min(STEP_BLOCKS, capacity // 8))
        fill, keys = keys[:capacity], keys[capacity:]
        for i in range(0, len(fill), batch):     # untimed: the pool fills, nothing evicted
            if not store(session, fill[i:i + batch], payload):
                raise RuntimeError("the reserve stayed short")
        settle(session)
        before, cpu0 = d.tier(), d.cpu()
        t0 = time.perf_counter()
        for i in range(0, len(keys), batch):
            if not store(session, keys[i:i + batch], payload):
                raise RuntimeError("the reserve stayed short")
        stored_s = time.perf_counter() - t0
        settle(session)                        # every STORE read: the evictions demoted
        d.wait(lambda: d.tier()["queue_depth"] == 0, "the tier's queue to empty", poll=0.005)
        wall = time.perf_counter() - t0
        cpu = d.cpu() - cpu0
        after, doc = d.tier(), d.stats()
        in_pool = doc["blocks"]["ready"]
        demoted = after["demoted_bytes_total"] - before["demoted_bytes_total"]
        write_s = after["write_seconds_total"] - before["write_seconds_total"]
        demotion = {
            "prefilled_blocks": len(fill),
            "stored_blocks": len(keys), "stored_bytes": len(keys) * block,
            "blocks_in_pool_after": in_pool,
            "demotions": after["demotions_total"] - before["demotions_total"],
            "demoted_bytes": demoted,
            "refused": after["demotions_refused_total"] - before["demotions_refused_total"],
            "engine_store_seconds": stored_s, "wall_seconds": wall,
            "write_seconds_total": write_s,
            "wall_gb_per_s": demoted / wall / 1e9,
            "io_thread_gb_per_s": demoted / (write_s / IO_THREADS) / 1e9 if write_s else 0.0,
            "daemon_cpu_seconds": cpu,
            "daemon_cpu_s_per_gb": cpu / (demoted / 1e9) if demoted else None,
        }
        # Read back everything the pool evicted (the oldest stores), an eighth pool a request.
        below = (fill + keys)[:len(fill) + len(keys) - in_pool]
        per = max(1, capacity // 8)
        before, cpu0 = after, d.cpu()
        t0 = time.perf_counter()
        states, steps = read_back_queue(session, [below[i:i + per]
                                                  for i in range(0, len(below), per)])
        wall = time.perf_counter() - t0
        settle(session)
        cpu = d.cpu() - cpu0
        after = d.tier()
        promoted = after["promoted_bytes_total"] - before["promoted_bytes_total"]
        read_s = after["read_seconds_total"] - before["read_seconds_total"]
        promotion = {
            "keys_read_back": len(below), **states, "steps": steps,
            "promotions": after["promotions_total"] - before["promotions_total"],
            "promoted_bytes": promoted, "wall_seconds": wall, "read_seconds_total": read_s,
            "wall_gb_per_s": promoted / wall / 1e9,
            "io_thread_gb_per_s": promoted / (read_s / IO_THREADS) / 1e9 if read_s else 0.0,
            # the pool's own blocks that the promotions evicted go down meanwhile (writes)
            "demoted_meanwhile_bytes": after["demoted_bytes_total"]
            - before["demoted_bytes_total"],
            "refused": after["promotions_refused_total"] - before["promotions_refused_total"],
            "late": after["promotions_late_total"] - before["promotions_late_total"],
            "daemon_cpu_seconds": cpu,
            "daemon_cpu_s_per_gb": cpu / (promoted / 1e9) if promoted else None,
        }
        tier = {k: after[k] for k in ("direct_io", "corrupt_total", "failures_total",
                                      "evictions_total", "health")}
        return {"pool_bytes": pool_mib * MIB, "pool_blocks": capacity,
                "disk_bytes": disk_mib * MIB, "demotion": demotion, "promotion": promotion,
                "tier": tier}
    finally:
        close_session(session)
        d.close()


def read_back(session: OffloadSession, keys: list[bytes]) -> tuple[dict, int]:
    """One request's keys read back (`read_back_queue` of one)."""
    return read_back_queue(session, [keys])


def read_back_queue(session: OffloadSession, requests: list[list[bytes]]
                    ) -> tuple[dict, int]:
    """Look the requests' keys up step after step as a scheduler does, PROMOTE_IN_FLIGHT
    requests at a time: one with no key HIT_PENDING any more (or waiting past STALL_S) loads
    its HITs (pin, unpin) and the next one joins. ({hit, miss, pending_given_up}: counts,
    steps)."""
    states = {"hit": 0, "miss": 0, "pending_given_up": 0}
    waiting = collections.deque(requests)
    active: list[tuple[list[bytes], float]] = []
    steps = 0
    while waiting or active:
        while waiting and len(active) < PROMOTE_IN_FLIGHT:
            active.append((waiting.popleft(), time.monotonic() + STALL_S))
        steps += 1
        still = []
        for keys, deadline in active:
            answers = [session.lookup(k) for k in keys]
            if Lookup.HIT_PENDING in answers and time.monotonic() <= deadline:
                still.append((keys, deadline))
                continue
            hits = [k for k, s in zip(keys, answers, strict=True) if s is Lookup.HIT]
            session.start_loads(hits)
            session.finish_loads(hits)
            states["hit"] += len(hits)
            states["miss"] += answers.count(Lookup.MISS)
            states["pending_given_up"] += answers.count(Lookup.HIT_PENDING)
        active = still
        session.end_step()
        if active:
            time.sleep(0.0005)
    return states, steps


def bracketed(before: dict, after: dict) -> dict:
    """One raw reference from the raw passes made just before and just after the tier's run
    (the drive's speed drifts within a minute: bracketing follows it): per way, the bytes over
    the mean of the two passes' seconds."""
    out = {"bytes": before["bytes"], "direct_io": before["direct_io"],
           "pool_bytes": before["pool_bytes"]}
    for op in ("write", "read", "reused_write", "reused_read"):
        runs = before[op]["runs_seconds"] + after[op]["runs_seconds"]
        secs = statistics.mean(runs)
        out[op] = {"runs_seconds": runs, "seconds": secs, "gb_per_s": out["bytes"] / secs / 1e9}
    return out


def _median_round(rounds: list[tuple[dict, dict]], side: str, op: str) -> tuple[dict, dict]:
    """(the tier's `side` figures, the raw figures) of the round whose ratio is the median:
    each round's tier is compared with the raw passes made just around it."""
    ranked = sorted(rounds, key=lambda rt: rt[1][side]["wall_gb_per_s"]
                    / rt[0][op]["gb_per_s"])
    r, t = ranked[len(ranked) // 2]
    return t[side], r


def bandwidth(base: Path, pool_mib: int, times: int, disk_mib: int, rounds: int = ROUNDS
              ) -> list[dict]:
    rows = []
    for block in SIZES:
        workdir = base / f"bw-{block >> 10}k"
        # The raw file in the tier's own directory, moving what the tier will demote.
        pool_blocks = pool_mib * MIB // block
        moved = pool_blocks * times * block
        # A shared VM's drive and CPUs vary by tens of percent from one minute to the next:
        # each round measures the raw drive, then the tier at once after it; the round with
        # the median ratio is reported (every round's figures are kept).
        done: list[tuple[dict, dict]] = []
        for _ in range(rounds):
            before = raw(workdir / "disk", block, moved, disk_mib * MIB, runs=1,
                         pool_bytes=pool_mib * MIB)
            t = demote_promote(workdir, block, pool_mib, times, disk_mib)
            shutil.rmtree(workdir, ignore_errors=True)
            after = raw(workdir / "disk", block, moved, disk_mib * MIB, runs=1,
                        pool_bytes=pool_mib * MIB)
            shutil.rmtree(workdir, ignore_errors=True)
            r = bracketed(before, after)
            for side, op in (("demotion", "write"), ("promotion", "read")):
                ref = r[op]["gb_per_s"]
                t[side]["wall_of_raw"] = t[side]["wall_gb_per_s"] / ref
                t[side]["io_thread_of_raw"] = t[side]["io_thread_gb_per_s"] / ref
                t[side]["wall_of_reused_raw"] = (t[side]["wall_gb_per_s"]
                                                 / r["reused_" + op]["gb_per_s"])
            done.append((r, t))
        dem, raw_w = _median_round(done, "demotion", "write")
        pro, raw_r = _median_round(done, "promotion", "read")
        r = {"bytes": done[0][0]["bytes"], "direct_io": done[0][0]["direct_io"],
             "pool_bytes": pool_mib * MIB, "write": raw_w["write"], "read": raw_r["read"],
             "reused_write": raw_w["reused_write"], "reused_read": raw_r["reused_read"]}
        rows.append({"block_bytes": block, "raw": r, **done[0][1], "demotion": dem,
                     "promotion": pro, "rounds": [
                         {"raw_write_gb_per_s": rr["write"]["gb_per_s"],
                          "raw_read_gb_per_s": rr["read"]["gb_per_s"],
                          "raw_reused_write_gb_per_s": rr["reused_write"]["gb_per_s"],
                          "raw_reused_read_gb_per_s": rr["reused_read"]["gb_per_s"],
                          "demotion_wall_gb_per_s": tt["demotion"]["wall_gb_per_s"],
                          "promotion_wall_gb_per_s": tt["promotion"]["wall_gb_per_s"]}
                         for rr, tt in done]})
        print(f"{block >> 10:5d} KiB  raw write {r['write']['gb_per_s']:.2f} read "
              f"{r['read']['gb_per_s']:.2f} GB/s ({'direct' if r['direct_io'] else 'buffered'}"
              f"; reused buffers {r['reused_write']['gb_per_s']:.2f} / "
              f"{r['reused_read']['gb_per_s']:.2f}: tier {dem['wall_of_reused_raw']:.0%} / "
              f"{pro['wall_of_reused_raw']:.0%})"
              f" | demotion wall {dem['wall_gb_per_s']:.2f} ({dem['wall_of_raw']:.0%}) "
              f"I/O {dem['io_thread_gb_per_s']:.2f} ({dem['io_thread_of_raw']:.0%}) "
              f"{dem['daemon_cpu_s_per_gb'] or 0:.2f} cpu-s/GB | promotion wall "
              f"{pro['wall_gb_per_s']:.2f} ({pro['wall_of_raw']:.0%}) I/O "
              f"{pro['io_thread_gb_per_s']:.2f} ({pro['io_thread_of_raw']:.0%}) "
              f"{pro['daemon_cpu_s_per_gb'] or 0:.2f} cpu-s/GB (median of {rounds} rounds)",
              flush=True)
    return rows


# --------------------------------------------------------------------------- 3. hits
def replay(session: OffloadSession | list[OffloadSession], requests: list[list[bytes]],
           pick: Callable[[int], int] | None = None, pace_s: float = 0.0) -> dict:
    """The trace through `session` as vLLM's scheduler drives it (see the module doc); with a
    list of sessions (engines on several daemons), request n goes to `pick(n)`'s, arriving
    `pace_s` after the one before (0: at once)."""
    sessions = session if isinstance(session, list) else [session]
    hits = lookups = waited_steps = given_up = declined = 0
    t0 = time.perf_counter()
    for n, keys in enumerate(requests):
        session = sessions[pick(n) if pick is not None else 0]
        due = t0 + n * pace_s
        if pace_s and time.perf_counter() < due:
            time.sleep(due - time.perf_counter())
        req = f"r{n}"
        lookups += len(keys)
        deadline = time.monotonic() + PENDING_WAIT_S
        while True:
            # vLLM 0.33's scan: HIT and HIT_PENDING both count into the prefix (so every block
            # of it held below is asked for in the same step), a MISS ends it; the request
            # waits while any block of its prefix is pending.
            states = []
            for k in keys:
                state = session.lookup(k)
                if state is Lookup.MISS:
                    break
                states.append(state)
            hit, pending = len(states), Lookup.HIT_PENDING in states
            if not pending:
                break
            if time.monotonic() > deadline:       # the request goes on without them
                given_up += 1
                hit = 0
                for k in keys:
                    if session.lookup(k) is not Lookup.HIT:
                        break
                    hit += 1
                break
            session.end_step()                      # the request waits a step
            waited_steps += 1
            time.sleep(0.0005)
        if hit:
            session.start_loads(keys[:hit], req)
            session.finish_loads(keys[:hit], req)
        hits += hit
        for i in range(hit, len(keys), STEP_BLOCKS):
            if not store(session, keys[i:i + STEP_BLOCKS], None, req):
                declined += 1
        session.request_finished(req)
        session.end_step()
    for session in sessions:
        settle(session)
    return {"lookup_blocks": lookups, "hit_blocks": hits, "hit_rate": hits / max(1, lookups),
            "steps_waited_for_pending": waited_steps, "requests_gave_up_waiting": given_up,
            "stores_declined": declined, "seconds": time.perf_counter() - t0}


def make_hot(s: OffloadSession, keys: list[bytes], d: Daemon | None) -> None:
    """Have `keys` in the pool (untimed): stored again where the pool let one go (a reserve
    refill or a promotion evicts too), until every one reads HIT (or 5 tries)."""
    for _ in range(5):
        missing = [k for k in keys if s.lookup(k) is not Lookup.HIT]
        s.end_step()
        if not missing:
            return
        settle(s)                            # promotions the lookups asked for: done
        if d is not None:
            d.wait(lambda: d.tier()["promotions_open"] == 0, "promotions to end")
        missing = [k for k in keys if s.lookup(k) is not Lookup.HIT]
        s.end_step()
        for i in range(0, len(missing), 64):
            store(s, missing[i:i + 64], None, "hot")
        s.request_finished("hot")            # the newest blocks of the pool (LRU)
        settle(s)


def lookup_times(sessions: dict[str, OffloadSession], hot: dict[str, list[bytes]],
                 cold: list[bytes], make_ready: Callable[[str], None]) -> dict:
    """ns per OffloadSession.lookup, keys in the pool (HIT) and held nowhere (MISS), rounds
    alternating between the daemons, each round after `make_ready(name)` (untimed) put the
    hot keys back in that pool; the medians over rounds."""
    per: dict[str, dict[str, list[float]]] = {n: {"hit": [], "miss": []} for n in sessions}
    names = list(sessions)
    for r in range(LOOKUP_ROUNDS):
        for name in names if r % 2 == 0 else names[::-1]:
            s = sessions[name]
            for _ in range(LOOKUP_TRIES):
                make_ready(name)
                s.lookup(b"\1")                  # starts the step (untimed)
                keys = hot[name]
                t0 = time.perf_counter_ns()
                got = [s.lookup(k) for k in keys]
                t1 = time.perf_counter_ns()
                for k in cold:
                    s.lookup(k)
                t2 = time.perf_counter_ns()
                s.end_step()
                # Between make_ready and the lookups the daemon may still evict a hot key
                # (its reserve refill takes the oldest blocks): that round is not timed.
                if got.count(Lookup.HIT) == len(keys):
                    break
            else:
                raise RuntimeError(f"{name} round {r}: keys stored in the pool did not read HIT "
                                   f"in {LOOKUP_TRIES} tries: {collections.Counter(got)}")
            per[name]["hit"].append((t1 - t0) / len(keys))
            per[name]["miss"].append((t2 - t1) / len(cold))
    out = {n: {f"{k}_ns_per_key": statistics.median(v) for k, v in p.items()}
           for n, p in per.items()}
    out["keys"], out["rounds"] = LOOKUP_KEYS, LOOKUP_ROUNDS
    for kind in ("hit", "miss"):
        out[f"{kind}_with_tier_over_without"] = (out["tier"][f"{kind}_ns_per_key"]
                                                 / out["no_tier"][f"{kind}_ns_per_key"])
    return out


def hit_rate_and_lookups(base: Path, trace: tuple[str, str] = HR_TRACE) -> tuple[dict, dict]:
    shape, size = trace
    requests = [list(block_keys(r.tokens, HR_TOKENS_PER_BLOCK)) for r in generate(shape, size)]
    distinct = len({k for keys in requests for k in keys})
    daemons: dict[str, Daemon] = {}
    sessions: dict[str, OffloadSession] = {}
    out: dict = {"trace": f"{shape}/{size}", "requests": len(requests),
                 "distinct_blocks": distinct, "block_bytes": HR_BLOCK,
                 "pool_bytes": HR_POOL_MIB * MIB, "disk_bytes": HR_DISK_MIB * MIB,
                 "pending_wait_seconds": PENDING_WAIT_S}
    try:
        for name in ("no_tier", "tier"):                 # in turn; both kept for the lookups
            workdir = base / f"hr-{name}"
            disk = workdir / "disk" if name == "tier" else None
            daemons[name] = d = Daemon(workdir, HR_POOL_MIB, disk, HR_DISK_MIB)
            sessions[name] = s = open_session(d.socket, HR_BLOCK, "bench-tiers-chat")
            out["pool_blocks"] = s.capacity
            out[name] = replay(s, requests)
            if disk is not None:
                d.wait(lambda d=d: d.tier()["queue_depth"] == 0, "the tier's queue to empty")
                tier = d.tier()
                out[name]["tier"] = {k: tier[k] for k in (
                    "blocks", "demotions_total", "promotions_total", "demotions_refused_total",
                    "promotions_refused_total", "evictions_total", "corrupt_total")}
            print(f"hit rate {name}: {out[name]['hit_blocks']} of {out[name]['lookup_blocks']}"
                  f" blocks ({out[name]['hit_rate']:.1%}) in {out[name]['seconds']:.1f}s",
                  flush=True)
        out["gain_blocks"] = out["tier"]["hit_blocks"] - out["no_tier"]["hit_blocks"]
        out["gain"] = out["tier"]["hit_blocks"] / max(1, out["no_tier"]["hit_blocks"])
        # 4. the hot path: fresh keys stored in both pools, looked up with and without a tier
        # (once the replay's last promotions are done: they would evict them; every record read
        # first, so none is asked for after the wait)
        for s in sessions.values():
            settle(s)
        daemons["tier"].wait(lambda: daemons["tier"].tier()["promotions_open"] == 0,
                             "the replay's promotions to end")
        hot = {name: keys_for(f"hot-{name}", LOOKUP_KEYS) for name in sessions}
        cold = keys_for("cold", LOOKUP_KEYS)
        lk = lookup_times(sessions, hot, cold, lambda name: make_hot(
            sessions[name], hot[name], daemons[name] if name == "tier" else None))
        lk["tier_blocks_held"] = daemons["tier"].tier()["blocks"]
        print(f"lookup ns/key: hit {lk['no_tier']['hit_ns_per_key']:.0f} without a tier, "
              f"{lk['tier']['hit_ns_per_key']:.0f} with; miss "
              f"{lk['no_tier']['miss_ns_per_key']:.0f} / {lk['tier']['miss_ns_per_key']:.0f}",
              flush=True)
        return out, lk
    finally:
        for s in sessions.values():
            close_session(s)
        for d in daemons.values():
            d.close()


# --------------------------------------------------------------------------- report
def run(base: Path, quick: bool = False) -> dict:
    t0 = time.time()
    pool_mib, times, disk_mib = BW_QUICK if quick else BW_FULL
    base.mkdir(parents=True, exist_ok=True)
    out: dict = {"machine": machine(), "commit": commit(), "quick": quick,
                 "directory": str(base), "filesystem": filesystem(base),
                 "io_threads": IO_THREADS, "queue_bytes": DEFAULT_QUEUE_BYTES,
                 "data_file": DATA_FILE}
    out["bandwidth"] = bandwidth(base, pool_mib, times, disk_mib)
    out["hit_rate"], out["lookup"] = hit_rate_and_lookups(
        base, HR_TRACE_QUICK if quick else HR_TRACE)
    bw = out["bandwidth"]
    out["targets"] = {
        "demotion_wall_ge_80pct_raw": all(r["demotion"]["wall_of_raw"] >= GOAL for r in bw),
        "promotion_wall_ge_80pct_raw": all(r["promotion"]["wall_of_raw"] >= GOAL for r in bw),
        "demotion_io_thread_ge_80pct_raw": all(r["demotion"]["io_thread_of_raw"] >= GOAL
                                               for r in bw),
        "promotion_io_thread_ge_80pct_raw": all(r["promotion"]["io_thread_of_raw"] >= GOAL
                                                for r in bw),
        # Against the raw passes through IO_THREADS hot buffers (what fio measures): on a VM
        # the host's copy into guest memory favours them; shown, not the like-for-like goal.
        "demotion_wall_ge_80pct_reused_buffer_raw": all(
            r["demotion"]["wall_of_reused_raw"] >= GOAL for r in bw),
        "promotion_wall_ge_80pct_reused_buffer_raw": all(
            r["promotion"]["wall_of_reused_raw"] >= GOAL for r in bw),
        "hits_gain_with_tier": out["hit_rate"]["gain_blocks"] > 0,
    }
    out["elapsed_seconds"] = time.time() - t0
    return out


def _gb(x: float) -> str:
    return f"{x:.2f}"


def table(t: dict) -> str:
    """bench/README.md's disk tier section."""
    m, hr, lk = t["machine"], t["hit_rate"], t["lookup"]
    direct = {r["raw"]["direct_io"] for r in t["bandwidth"]}
    io = "O_DIRECT" if direct == {True} else "buffered (no O_DIRECT)" if direct == {False} \
        else "mixed"
    first = t["bandwidth"][0]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores. Commit: `{t['commit']}`. Directory on "
             f"{t['filesystem']}, {io}, {t['io_threads']} I/O threads; pool "
             f"{first['pool_bytes'] // MIB} MiB, "
             f"{first['demotion']['stored_bytes'] // first['pool_bytes']}x the pool stored "
             f"after filling it, disk {first['disk_bytes'] // MIB} MiB; per size the median of "
             f"{len(first.get('rounds', [])) or 1} rounds (raw pass, the tier, raw pass: the "
             "tier against the mean of the two).", "",
             "| block | raw write / read GB/s, pool-sized memory | raw write / read GB/s, "
             f"{t['io_threads']} reused buffers | demotion GB/s wall (of raw; of reused) | "
             "demotion GB/s I/O threads (of raw) | promotion GB/s wall (of raw; of reused) | "
             "promotion GB/s I/O threads (of raw) | daemon CPU s/GB demoted, promoted |",
             "|---|---|---|---|---|---|---|---|"]
    for r in t["bandwidth"]:
        raw_, dem, pro = r["raw"], r["demotion"], r["promotion"]
        lines.append(
            f"| {r['block_bytes'] >> 10} KiB | {_gb(raw_['write']['gb_per_s'])} / "
            f"{_gb(raw_['read']['gb_per_s'])} "
            f"| {_gb(raw_['reused_write']['gb_per_s'])} / "
            f"{_gb(raw_['reused_read']['gb_per_s'])} "
            f"| {_gb(dem['wall_gb_per_s'])} ({dem['wall_of_raw']:.0%}; "
            f"{dem['wall_of_reused_raw']:.0%}) "
            f"| {_gb(dem['io_thread_gb_per_s'])} ({dem['io_thread_of_raw']:.0%}) "
            f"| {_gb(pro['wall_gb_per_s'])} ({pro['wall_of_raw']:.0%}; "
            f"{pro['wall_of_reused_raw']:.0%}) "
            f"| {_gb(pro['io_thread_gb_per_s'])} ({pro['io_thread_of_raw']:.0%}) "
            f"| {dem['daemon_cpu_s_per_gb'] or 0:.2f}, {pro['daemon_cpu_s_per_gb'] or 0:.2f} |")
    lines += ["", f"Read back ({PROMOTE_IN_FLIGHT} requests of an eighth of the pool at once), "
              "keys held on disk that read MISS (no pool slot for them within the engine's asks) / keys, and promotions refused for a "
              "slot: " + ", ".join(
                  f"{r['block_bytes'] >> 10} KiB {r['promotion']['miss']} / "
                  f"{r['promotion']['keys_read_back']}, {r['promotion']['refused']} refused"
                  for r in t["bandwidth"]) + "; demotions refused (queue full): " + ", ".join(
                  str(r["demotion"]["refused"]) for r in t["bandwidth"]) + "."]
    nt, wt = hr["no_tier"], hr["tier"]
    lines += ["", f"Hits, {hr['trace']} ({hr['requests']} requests, {hr['distinct_blocks']} "
              f"distinct blocks of {hr['block_bytes'] >> 10} KiB) through an OffloadSession, "
              f"pool {hr['pool_bytes'] // MIB} MiB ({hr['pool_blocks']} blocks): "
              f"{nt['hit_blocks']} of {nt['lookup_blocks']} blocks hit without a tier "
              f"({nt['hit_rate']:.1%}), {wt['hit_blocks']} with a "
              f"{hr['disk_bytes'] // MIB} MiB disk tier ({wt['hit_rate']:.1%}): "
              f"**{hr['gain']:.2f}x** ({wt['steps_waited_for_pending']} steps waited on "
              f"HIT_PENDING, {wt['requests_gave_up_waiting']} requests gave up waiting).", "",
              f"Lookup on the scheduler thread (OffloadSession.lookup, {lk['keys']} keys, "
              f"median of {lk['rounds']} rounds), ns per key without / with a tier: in the "
              f"pool {lk['no_tier']['hit_ns_per_key']:.0f} / {lk['tier']['hit_ns_per_key']:.0f}"
              f" ({lk['hit_with_tier_over_without']:.2f}x), held nowhere "
              f"{lk['no_tier']['miss_ns_per_key']:.0f} / {lk['tier']['miss_ns_per_key']:.0f} "
              f"({lk['miss_with_tier_over_without']:.2f}x).", "",
              "| target | |", "|---|---|"]
    lines += [f"| {name} | {'met' if ok else '**missed**'} |" for name, ok in
              t["targets"].items()]
    return "\n".join(lines) + "\n"


def record(t: dict, key: str = "tiers", text: str | None = None,
           marker: str = "tiers-results") -> None:
    """`t` as `key` of results/latest.json (every other key kept) and its table (`text`,
    default this bench's) between bench/README.md's `marker` lines."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "latest.json"
    latest = json.loads(path.read_text()) if path.exists() else {}
    latest[key] = t
    path.write_text(json.dumps(latest, indent=2) + "\n")
    _fill(HERE / "README.md", table(t) if text is None else text, marker)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller run")
    ap.add_argument("--dir", help="a directory on the drive to measure (default: a new one "
                    "under /var/tmp)")
    ap.add_argument("--no-record", action="store_true",
                    help="print the results only (latest.json and the README untouched)")
    args, _ = ap.parse_known_args()     # make bench passes run_all.py's BENCH_ARGS too
    if args.dir:
        base = Path(args.dir) / f"kvd-tiers-{os.getpid()}"
        try:
            result = run(base, args.quick)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    else:
        with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="kvd-tiers-") as tmp:
            result = run(Path(tmp), args.quick)
    if not args.no_record:
        record(result)
    print(json.dumps(result["targets"], indent=2))
    print(f"tiers: {result['elapsed_seconds']:.0f}s"
          + ("" if args.no_record else f"; wrote {RESULTS / 'latest.json'} (tiers)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
