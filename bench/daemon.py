"""Daemon benchmarks: step throughput from concurrent clients, lookup latency vs index size,
daemon memory per resident block, and the raw stream round trip a step is compared with.

Every client is a separate process talking to a real `kvd serve` over its Unix socket.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from kvd_client.attach import attach  # noqa: E402
from kvd_proto import SESSION_TOKEN_METADATA, kvd_pb2, kvd_pb2_grpc  # noqa: E402
from kvd_proto.paths import grpc_target  # noqa: E402

BLOCK = 4096
# The memory figure is taken with vLLM's keys (a 32-byte hash + a 4-byte group: 36 bytes, 40
# wide in the index, as kvd_client.vllm declares them): a 28-byte prefix + an 8-byte counter.
VLLM_KEY_WIDTH = 40
BIG_PREFIX = b"big".ljust(28, b".")


def start_daemon(workdir: str, pool: str, *extra: str, prefault: bool = False
                 ) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(workdir, "kvd.sock")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVD_POOL_PREFAULT": str(prefault).lower(),
           "KVD_MANAGER_LIVENESS_TIMEOUT": "60s"}
    log = open(os.path.join(workdir, "kvd.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "kvd_server", "serve", "--socket", sock,
                             "--pool-size", pool, *extra], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = subprocess.run([sys.executable, "-m", "kvd_server", "health", "--socket", sock],
                           env=env, capture_output=True)
        if r.returncode == 0:
            return proc, sock
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("daemon did not start")


class Session:
    def __init__(self, sock: str, model: str = "bench", key_bytes: int = 0) -> None:
        info = attach(sock)
        os.close(info.fd)
        self.channel = grpc.insecure_channel(grpc_target(sock))
        self.stub = kvd_pb2_grpc.KvdEngineStub(self.channel)
        self.md = ((SESSION_TOKEN_METADATA, info.token),)
        self.reg = self.stub.RegisterSession(kvd_pb2.RegisterSessionRequest(
            model=model, layout=kvd_pb2.KvLayout(block_bytes=BLOCK, num_ranks=1,
                                                 shard_bytes=BLOCK, max_key_bytes=key_bytes)),
            metadata=self.md, timeout=5)
        self._steps = None

    def step(self, ops: list[kvd_pb2.StepOp]) -> kvd_pb2.StepResponse:
        """A unary Step call."""
        return self.stub.Step(kvd_pb2.StepRequest(ops=ops), metadata=self.md, timeout=5)

    def stream_step(self, ops: list[kvd_pb2.StepOp]) -> kvd_pb2.StepResponse:
        """A step on the session's StepStream, as KvdClient sends it."""
        if self._steps is None:
            from kvd_client.step_stream import StepStream

            self._steps = StepStream(self.stub, self.md)
        return self._steps.call(kvd_pb2.StepRequest(ops=ops), 5.0)

    def fill(self, n: int, prefix: bytes) -> None:
        """Store n blocks (bytes are not written: only the index is measured)."""
        for start in range(0, n, 4096):
            keys = [prefix + i.to_bytes(8, "big") for i in range(start, min(n, start + 4096))]
            r = self.step([kvd_pb2.StepOp(prepare_store=kvd_pb2.PrepareStoreRequest(keys=keys))])
            got = r.results[0].prepare_store
            self.step([kvd_pb2.StepOp(complete_store=kvd_pb2.CompleteStoreRequest(
                keys=got.keys_to_store, success=True, epoch=got.epoch))])
            self.drain_events()

    def drain_events(self) -> None:
        """Take the stored events, as an engine does every step (undrained, they would hold
        every key once more until MAX_PENDING_EVENTS)."""
        take = kvd_pb2.StepOp(take_events=kvd_pb2.TakeEventsRequest(max_events=65536))
        while self.step([take]).results[0].take_events.more:
            pass


def _client(sock: str, seconds: float, keys_per_step: int, seed: int, out: mp.Queue,
            stream: bool, start: Any) -> None:
    s = Session(sock)
    step = s.stream_step if stream else s.step
    step([])                           # the stream is open before the clock starts
    import random

    rng = random.Random(seed)
    steps = 0
    lat = []
    start.wait(120)                    # every client starts at once
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        keys = [b"hot" + rng.randrange(50_000).to_bytes(8, "big")
                for _ in range(keys_per_step)]
        t0 = time.perf_counter()
        step([kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(keys=list(dict.fromkeys(keys))))])
        lat.append(time.perf_counter() - t0)
        steps += 1
    out.put((steps, lat))


def _run_clients(clients: int, seconds: float, job) -> list:  # noqa: ANN001
    """Start `clients` spawned processes (`job(i, queue, barrier)` -> (target, args)), release
    them together and collect what each puts on the queue. Spawned: this process has gRPC
    threads, never fork it."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start = ctx.Barrier(clients + 1)
    procs = [ctx.Process(target=target, args=args)
             for target, args in (job(i, q, start) for i in range(clients))]
    for p in procs:
        p.start()
    start.wait(120)
    results = [q.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join(10)
    return results


def throughput(sock: str, clients: int, seconds: float = 3.0, keys: int = 64,
               stream: bool = True) -> dict:
    """Step calls/s from `clients` processes, each stepping in lockstep (64-key lookups) on
    its StepStream (`stream`) or with unary Step calls."""
    results = _run_clients(clients, seconds,
                           lambda i, q, start: (_client, (sock, seconds, keys, i, q, stream,
                                                          start)))
    steps = sum(r[0] for r in results)
    lat = sorted(x for r in results for x in r[1])
    return {"clients": clients, "transport": "stream" if stream else "unary",
            "steps_per_second": steps / seconds,
            "p50_seconds": lat[len(lat) // 2], "p99_seconds": lat[int(len(lat) * 0.99)]}


STEP_KEYS = 16          # per engine step: a store of 16 new keys, a load of 16 stored ones
MAX_LEAD = 64           # steps an engine may run ahead of what the daemon has read
LOAD_BACK = MAX_LEAD + 2    # a step loads the blocks stored this many steps before: by then
                            # the daemon has read their store and its completion, so they
                            # answer HIT from the index (two steps back, an engine running
                            # ahead found its own stores not read yet and loaded nothing)


def _channel_engine(sock: str, seconds: float, seed: int, out: Any, start: Any,
                    run: bytes = b"\0" * 4) -> None:
    """An engine process on the fast path (the real OffloadSession over its channel): every
    step it looks up, loads (pin, unpin) and ends the request of 16 blocks stored LOAD_BACK
    steps before, and stores 16 new ones (reserve, complete): 5 records, 64 keys of daemon
    work (`loaded_share` says how many steps found their blocks and loaded them,
    `records_per_step` how many records a step wrote: 5, and a few of the reserve's and the
    counters'; fewer, and the steps counted did less work).
    No bytes are copied (the daemon's side is measured). It runs at most MAX_LEAD steps
    ahead of what the daemon has read, so what is counted is what the daemon processed."""
    from kvd_client.client import KvdClient
    from kvd_client.offload.session import OffloadSession
    from kvd_proto.wire import KvLayout

    client = KvdClient(sock, model="bench-channel", engine_id=f"bench-{seed}",
                       layout=KvLayout(BLOCK, 1, BLOCK, 16, "bf16", VLLM_KEY_WIDTH))
    session = OffloadSession(client)
    assert client.wait_available(30)
    # Keys shaped as vLLM's (make_offload_key): a 32-byte block hash, then the KV group as 4
    # big-endian bytes, 0 for a model with one KV cache group. The daemon orders a request's
    # blocks per group (kvd_server/manager/requests.py); keys whose last 4 bytes differ
    # would each be a group of their own, which no model has.
    # The run's own 4 bytes first: a run's keys are new to the daemon (a second run over the
    # same keys found them stored by the first, skipped its stores and cost the daemon less).
    prefix = run + seed.to_bytes(4, "big") + b"chan".ljust(16, b".")
    group = (0).to_bytes(4, "big")
    stored: deque[list[bytes]] = deque(maxlen=LOAD_BACK)
    counts = {"steps": 0, "loaded": 0}

    def one_step() -> None:
        step = counts["steps"]
        req = f"r{step}"
        if len(stored) == LOAD_BACK:
            keys = stored[0]
            hits = [k for k in keys if session.lookup(k) is not None and
                    session.hit_offset(k) is not None]
            session.start_loads(hits, req)
            session.finish_loads(hits, req)
            counts["loaded"] += len(hits) == len(keys)
        new = [prefix + (step * STEP_KEYS + i).to_bytes(8, "big") + group
               for i in range(STEP_KEYS)]
        granted = session.reserve(new, req)
        if granted:
            session.complete_store([k for k, _ in granted], req)
        stored.append(new)
        session.request_finished(req)
        session.end_step()
        counts["steps"] = step + 1

    # Before the clock: the session's channel, then the first LOAD_BACK steps (they have
    # nothing to load yet), read by the daemon.
    deadline = time.monotonic() + 30
    while not session.available and time.monotonic() < deadline:
        session.has_pending_work()
        time.sleep(0.01)
    while counts["steps"] < LOAD_BACK:
        one_step()
    deadline = time.monotonic() + 30
    while session.acked_steps < counts["steps"] and time.monotonic() < deadline:
        session.has_pending_work()
        time.sleep(0.001)
    start.wait(120)
    acked_at_start, steps_at_start = session.acked_steps, counts["steps"]
    generation_at_start = client.generation
    sent_at_start, loaded_at_start = session.messages_sent, counts["loaded"]
    end = time.monotonic() + seconds
    acked_at_end = 0
    while True:
        now = time.monotonic()
        if now >= end:
            acked_at_end = session.acked_steps
            break
        if counts["steps"] - session.acked_steps > MAX_LEAD:
            session.has_pending_work()            # reads the daemon's position
            time.sleep(0.001)
            continue
        one_step()
    steps = counts["steps"] - steps_at_start
    out.put((acked_at_end - acked_at_start, steps, session.messages_sent - sent_at_start,
             counts["loaded"] - loaded_at_start, client.generation - generation_at_start))
    session.close()
    client.close()


def channel_throughput(sock: str, clients: int, seconds: float = 3.0) -> dict:
    """Engine steps per second the daemon processed from `clients` fast-path engines, each
    stepping as fast as the daemon reads (see `_channel_engine`)."""
    run = os.urandom(4)
    results = _run_clients(clients, seconds,
                           lambda i, q, start: (_channel_engine,
                                                (sock, seconds, i, q, start, run)))
    acked = sum(r[0] for r in results)
    steps = max(1, sum(r[1] for r in results))
    return {"clients": clients, "transport": "channel", "keys_per_step": 4 * STEP_KEYS,
            "steps_per_second": acked / seconds,
            "records_per_step": sum(r[2] for r in results) / steps,
            "loaded_share": sum(r[3] for r in results) / steps,
            # Sessions an engine had to start again (its records of the old one are dropped:
            # steps counted then cost the daemon nothing). A fair run has none.
            "sessions_restarted": sum(r[4] for r in results)}


def lookup_samples(s: Session, resident_prefix: bytes, resident: int, n: int,
                   seed: int) -> list[float]:
    """Latencies of n 64-key lookup steps over keys resident in `s`'s namespace."""
    import random

    rng = random.Random(seed)
    lat = []
    for _ in range(n):
        keys = list(dict.fromkeys(resident_prefix + rng.randrange(resident).to_bytes(8, "big")
                                  for _ in range(64)))
        t0 = time.perf_counter()
        s.stream_step([kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(keys=keys))])
        lat.append(time.perf_counter() - t0)
    return lat


def _summary(lat: list[float], resident: int) -> dict:
    lat = sorted(lat)
    return {"resident_blocks": resident, "samples": len(lat), "p50_seconds": lat[len(lat) // 2],
            "p99_seconds": lat[int(len(lat) * 0.99)]}


def stream_rtt(s: Session, n: int = 2000) -> float:
    """Median round trip of one message on an open bidirectional stream (SessionStream)."""
    import queue

    requests: queue.Queue = queue.Queue()

    def gen() -> Iterator[kvd_pb2.SessionStreamRequest]:
        while True:
            item = requests.get()
            if item is None:
                return
            yield item

    call = s.stub.SessionStream(gen(), metadata=s.md)
    times = []
    it = iter(call)
    for i in range(n):
        t0 = time.perf_counter()
        requests.put(kvd_pb2.SessionHeartbeat(seq=i + 1))
        next(it)
        times.append(time.perf_counter() - t0)
    requests.put(None)
    call.cancel()
    times.sort()
    return times[len(times) // 2]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run(quick: bool = False) -> dict:
    """Two daemons side by side, one holding 10k blocks and one 1M, their lookups interleaved
    in rounds so machine noise falls on both alike; throughput as the median of 3 runs."""
    out: dict = {}
    big = 100_000 if quick else 1_000_000
    with tempfile.TemporaryDirectory(prefix="kvd-b-", dir="/tmp") as work:
        small_dir, big_dir = os.path.join(work, "small"), os.path.join(work, "big")
        os.mkdir(small_dir)
        os.mkdir(big_dir)
        # One 4 KiB slot per block, pools not pre-faulted (slots are never written here).
        small_proc, small_sock = start_daemon(small_dir, "256MiB", "--extent-size", "64MiB")
        # Room for the big namespace and, in extents of its own, the 50k hot blocks.
        big_pool = f"{(big + 120_000) * BLOCK // (1 << 20) + 128}MiB"
        proc, sock = start_daemon(big_dir, big_pool, "--extent-size", "64MiB")
        try:
            out["stream_rtt_seconds"] = stream_rtt(Session(sock))  # ends that session
            small = Session(small_sock)
            small.fill(10_000, b"res")
            # Before the namespace exists: its shared index and arrays count, as they fill.
            rss0 = rss_bytes(proc.pid)
            s = Session(sock, model="bench-vllm-keys", key_bytes=VLLM_KEY_WIDTH)
            s.fill(big, BIG_PREFIX)
            rss1 = rss_bytes(proc.pid)
            out["memory"] = {"resident_blocks": big, "rss_before_bytes": rss0,
                             "rss_after_bytes": rss1, "bytes_per_block": (rss1 - rss0) / big,
                             "key_bytes": len(BIG_PREFIX) + 8, "index_key_width": VLLM_KEY_WIDTH,
                             "counts": "the daemon's RSS growth from before the namespace "
                                       "existed: its shared index, block arrays and all"}
            lat_small: list[float] = []
            lat_big: list[float] = []
            for r in range(10):
                lat_small += lookup_samples(small, b"res", 10_000, 300, seed=r)
                lat_big += lookup_samples(s, BIG_PREFIX, big, 300, seed=r)
            out["lookup_10k"] = _summary(lat_small, 10_000)
            out["lookup_big"] = _summary(lat_big, big)
            Session(sock).fill(50_000, b"hot")      # the namespace the clients step in
            seconds = 2.0 if quick else 3.0
            out["throughput"] = [throughput(sock, c, seconds=seconds) for c in (1, 2, 4)]
            runs = sorted((throughput(sock, 8, seconds=seconds) for _ in range(3)),
                          key=lambda t: t["steps_per_second"])
            out["throughput"].append({**runs[1], "runs_steps_per_second":
                                      [t["steps_per_second"] for t in runs]})
            out["throughput_unary"] = [throughput(sock, 8, seconds=seconds, stream=False)]
            runs = sorted((channel_throughput(sock, 8, seconds=seconds) for _ in range(3)),
                          key=lambda t: t["steps_per_second"])
            out["throughput_channel"] = [channel_throughput(sock, 1, seconds=seconds),
                                         {**runs[1], "runs_steps_per_second":
                                          [t["steps_per_second"] for t in runs]}]
        finally:
            for p in (proc, small_proc):
                p.terminate()
                p.wait(30)
    return out


if __name__ == "__main__":
    if "--channel" in sys.argv:            # only the fast-path engines' throughput
        with tempfile.TemporaryDirectory(prefix="kvd-b-", dir="/tmp") as work:
            proc, sock = start_daemon(work, "512MiB", "--extent-size", "64MiB")
            try:
                print(json.dumps([channel_throughput(sock, c) for c in (1, 8)], indent=2))
            finally:
                proc.terminate()
                proc.wait(30)
    else:
        print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
