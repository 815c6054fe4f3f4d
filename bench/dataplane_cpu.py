"""Data plane on the CPU: planner + copies of 32 KiB fragments into slots, against one
contiguous copy of the same bytes measured in the same run (the memcpy ceiling)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvd_client.dataplane import EngineTensor, GroupRef, make_layout, plan_transfer
from kvd_client.dataplane.cpu import execute

PAGE = 32 << 10


def run(total_mib: int = 256, blocks_per_chunk: int = 4, repeats: int = 7) -> dict:
    n_blocks = (total_mib << 20) // PAGE
    engine = np.random.default_rng(0).integers(0, 255, size=n_blocks * PAGE, dtype=np.uint8)
    pool = np.zeros_like(engine)
    tensor = EngineTensor(engine.ctypes.data, PAGE, PAGE, n_blocks)
    layout = make_layout([tensor], [(GroupRef(0, PAGE),)], blocks_per_chunk)
    rng = np.random.default_rng(1)
    ids = rng.permutation(n_blocks).tolist()                 # scattered engine blocks
    n_chunks = n_blocks // blocks_per_chunk
    slots = (rng.permutation(n_chunks) * layout.slot_bytes).tolist()
    plan_s, copy_s, memcpy_s = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = plan_transfer(layout, [tensor], pool_base=pool.ctypes.data, rank=0,
                             slot_offsets=slots, block_ids=ids, group_sizes=[n_blocks],
                             block_indices=[0], to_pool=True)
        t1 = time.perf_counter()
        execute(plan)
        t2 = time.perf_counter()
        np.copyto(pool, engine)
        t3 = time.perf_counter()
        plan_s.append(t1 - t0)
        copy_s.append(t2 - t1)
        memcpy_s.append(t3 - t2)
    nbytes = n_blocks * PAGE
    kvd = statistics.median(p + c for p, c in zip(plan_s, copy_s))
    base = statistics.median(memcpy_s)
    return {"fragment_bytes": PAGE, "fragments": n_blocks, "runs_after_coalescing": len(plan),
            "bytes": nbytes, "plan_seconds": statistics.median(plan_s),
            "copy_seconds": statistics.median(copy_s), "kvd_gbps": nbytes / kvd / 1e9,
            "memcpy_gbps": nbytes / base / 1e9, "fraction_of_memcpy": base / kvd}


def plan_layers(layers: int = 64, blocks: tuple[int, ...] = (16, 128, 1024),
                page: int = 16 << 10, repeats: int = 31) -> list[dict]:
    """The planner alone on an engine's per-layer layout (one tensor per layer, as vLLM's
    canonical KV caches are): microseconds per transfer of `blocks` scattered blocks. A
    worker plans every job it is handed, on the engine's thread, before its copies start."""
    tensors = [EngineTensor((1 << 40) + i * (1 << 34), page, page, 1 << 16)
               for i in range(layers)]
    layout = make_layout(tensors, [tuple(GroupRef(i, page) for i in range(layers))], 1)
    rng = np.random.default_rng(2)
    out = []
    for n in blocks:
        ids = rng.permutation(1 << 16)[:n]
        slots = rng.permutation(1 << 16)[:n] * layout.slot_bytes
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan = plan_transfer(layout, tensors, pool_base=1 << 30, rank=0, slot_offsets=slots,
                                 block_ids=ids, group_sizes=[n], block_indices=[0],
                                 to_pool=True)
            times.append(time.perf_counter() - t0)
        out.append({"layers": layers, "blocks": n, "runs": len(plan),
                    "plan_us": statistics.median(times) * 1e6})
    return out


if __name__ == "__main__":
    print(json.dumps({**run(), "plan_layers": plan_layers()}, indent=2))
