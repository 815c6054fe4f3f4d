"""The daemon's own cost per engine step, in one process, with nothing competing for the CPU.

`bench/daemon.py`'s channel throughput runs 8 engine processes and the daemon on the same
cores, so its figure moves with the machine's scheduling (+-7% run to run on a 2-core VM).
Here the same kind of records (encoded by kvd_proto.records, as engines write them) go through
real channels into the daemon's own `ChannelHub` and `ChannelService` on a real `KvdCore`, in
one process: the time is the daemon's (decoding, the manager, the policy, the index, the
answers), and under `valgrind --tool=callgrind` its instruction count repeats to ~0.03%, which
is how daemon-side changes are compared (`--callgrind`: instrumentation on around the timed
steps only).

Shapes (`--shape`):
- `channel`: bench/daemon.py's step: pin and complete the 16 blocks stored 66 steps before,
  store 16 new ones and complete them, end the request (5 records, 64 keys).
- `chat`: multi-turn requests: each step is the next turn of a conversation, which pins and
  completes its whole prefix (up to `--turns` x 16 blocks, with token positions, as vLLM
  sends them) and stores 16 new blocks; a new conversation after `--turns` turns.

The pool is small (64 MiB of 4 KiB blocks by default) so that the namespace evicts from the
first timed step: eviction is the daemon's steady state under load.

Run: `python bench/daemon_core.py [--shape channel|chat] [--policy lru|arc] [--engines 8]
[--steps 3000] [--reps 5] [--pool-mib 64]`; prints JSON (µs a step: each rep, min, median).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvd_client.link.channel import Outbox, SessionChannel  # noqa: E402
from kvd_proto import records as rec  # noqa: E402
from kvd_proto.channel import ChannelHeader  # noqa: E402
from kvd_proto.wire import KvLayout  # noqa: E402
from kvd_server.channel.hub import ChannelHub  # noqa: E402
from kvd_server.channel.service import ChannelService  # noqa: E402
from kvd_server.config import load_config  # noqa: E402
from kvd_server.core.core import KvdCore  # noqa: E402
from kvd_server.core.peer import PeerCred  # noqa: E402
from kvd_server.core.sessions import EngineInfo  # noqa: E402
from kvd_server.memory.extents import ExtentAllocator  # noqa: E402
from kvd_server.protocols.wiring import EngineProtocols  # noqa: E402

KEYS = 16                  # new blocks a step stores
LOAD_BACK = 66             # `channel`: a step loads the blocks stored this many steps before
LAYOUT = KvLayout(4096, 1, 4096, 16, "bf16", 40)     # vLLM's 36-byte keys, 40 wide
GROUP = (0).to_bytes(4, "big")                        # KV cache group 0, as vLLM's keys end


def make_core(pool_bytes: int, policy: str) -> KvdCore:
    overrides = {"pool.size": (str(pool_bytes), "bench"),
                 "pool.extent_size": (str(pool_bytes), "bench"),
                 "manager.policy": (policy, "bench")}
    cfg = load_config(None, env={}, overrides=overrides)
    core = KvdCore(cfg, ExtentAllocator(cfg.pool.size, cfg.pool.extent_size),
                   clock=time.monotonic, alive=lambda pid: True)
    core.set_serving()
    return core


class Engine:
    """One engine's end of a channel: the records of its steps, the slots it was granted."""

    def __init__(self, core: KvdCore, hub: ChannelHub, number: int, shape: str,
                 turns: int) -> None:
        s = core.attach(PeerCred(pid=os.getpid(), uid=os.getuid(), gid=os.getgid()))
        assert s is not None
        core.register(s, EngineInfo(engine_id=f"bench-{number}"), "bench", LAYOUT, "")
        channel = hub.open(s, s.id)
        self.channel = SessionChannel(os.dup(channel.fd), os.dup(channel.wake_fd))
        self.outbox = Outbox()
        self.shape, self.turns = shape, turns
        self.epoch = s.ns.mgr.epoch if s.ns is not None else 0
        self.granted: deque[int] = deque()
        self.stored: deque[list[tuple[bytes, int]]] = deque(maxlen=LOAD_BACK)
        self.conversation: list[tuple[bytes, int]] = []
        self.prefix = os.urandom(4) + number.to_bytes(4, "big") + b"core".ljust(12, b".")
        self.conversations = 0
        self.steps = 0
        self.seq = 0
        self._send([rec.encode_reserve(4 * KEYS)])

    def _send(self, records: list[bytes]) -> None:
        self.seq += 1
        self.outbox.put_many(self.seq, records)
        self.outbox.flush(self.channel)

    def _key(self, n: int) -> bytes:
        return self.prefix + self.conversations.to_bytes(4, "big") + n.to_bytes(8, "big") + \
            GROUP

    def step(self) -> None:
        for answer in self.channel.receive():
            if isinstance(answer, rec.Granted):
                self.granted.extend(answer.offsets)
        req = f"r{self.steps}"
        records: list[bytes] = []
        if self.shape == "chat":
            if len(self.conversation) >= self.turns * KEYS:
                self.conversation = []
                self.conversations += 1
            loads, base = self.conversation, len(self.conversation)
        else:
            loads = self.stored[0] if len(self.stored) == LOAD_BACK else []
            base = self.steps * KEYS
        if loads:
            keys = [k for k, _ in loads]
            positions = list(range(len(keys))) if self.shape == "chat" else None
            records.append(rec.encode_pin(keys, req, positions, [o for _, o in loads]))
            records.append(rec.encode_complete_load(keys, req, self.epoch))
        new = [self._key(base + i) for i in range(KEYS)]
        n = min(KEYS, len(self.granted))
        offsets = [self.granted.popleft() for _ in range(n)]
        if n:
            if self.shape == "chat":
                offered = [k for k, _ in self.conversation] + new
                positions = list(range(len(offered)))
                index = list(range(base, base + n))
            else:
                offered, positions, index = new, None, list(range(n))
            records.append(rec.encode_store(offered, req, positions, index, offsets))
            records.append(rec.encode_complete_store(new[:n], True, req, self.epoch))
            stored = list(zip(new[:n], offsets, strict=True))
            self.stored.append(stored)
            self.conversation.extend(stored)
        records.append(rec.encode_request_finished(req))
        self._send(records)
        self.steps += 1


def run(shape: str = "channel", policy: str = "lru", engines: int = 8, steps: int = 3000,
        reps: int = 5, pool_mib: int = 64, turns: int = 6, callgrind: bool = False) -> dict:
    core = make_core(pool_mib << 20, policy)
    header = ChannelHeader()
    service = ChannelService(core, EngineProtocols.over(core), header.down_max_record)
    hub = ChannelHub(service, heartbeat=core.heartbeat,
                     on_broken=lambda s, why: sys.exit(f"a channel broke: {why}"),
                     header=header)
    fleet = [Engine(core, hub, i, shape, turns) for i in range(engines)]
    hub.poll()

    def rounds(n: int) -> float:
        """n engine steps (every engine in turn, then one daemon turn): the daemon's time."""
        spent = 0.0
        for _ in range(max(1, n // engines)):
            for engine in fleet:
                engine.step()
            t0 = time.perf_counter()
            hub.poll()
            spent += time.perf_counter() - t0
        return spent

    # Past the first LOAD_BACK steps and until the pool evicts.
    slots = (pool_mib << 20) // LAYOUT.block_bytes
    rounds(engines * (LOAD_BACK + 10) + 2 * slots // KEYS)
    if callgrind:
        subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=False,
                       capture_output=True)
        rounds(steps)
        subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], check=False,
                       capture_output=True)
        return {"shape": shape, "policy": policy, "steps": steps, "callgrind": True}
    per_step = [rounds(steps) / steps * 1e6 for _ in range(reps)]
    evictions = sum(ns.mgr.counters.evictions_total for ns in core.namespaces)
    return {"shape": shape, "policy": policy, "engines": engines, "pool_mib": pool_mib,
            "steps_per_rep": steps, "us_per_step": per_step, "min_us": min(per_step),
            "median_us": statistics.median(per_step), "evictions": evictions,
            "rejected": service.rejected_total}          # a fair run has none


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("channel", "chat"), default="channel")
    parser.add_argument("--policy", choices=("lru", "arc"), default="lru")
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3000, help="engine steps a rep")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--pool-mib", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6, help="turns a conversation (chat)")
    parser.add_argument("--callgrind", action="store_true",
                        help="one rep with callgrind's instrumentation on around it only "
                             "(run under valgrind --tool=callgrind --instr-atstart=no)")
    args = parser.parse_args()
    print(json.dumps(run(args.shape, args.policy, args.engines, args.steps, args.reps,
                         args.pool_mib, args.turns, args.callgrind), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
