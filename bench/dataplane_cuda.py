"""GPU data plane: kvd's planner + CUDA backend vs one large pinned copy (run on a GPU machine).

Stores (GPU -> pool) and loads (pool -> GPU) of scattered 32 KiB pages coalesced into slots,
against a single cudaMemcpy of the same bytes between a pinned host buffer and the GPU; prints
GB/s for both and the fraction. Not part of `make bench` on CPU-only machines.
"""

from __future__ import annotations

import json
import mmap
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvd_client.dataplane import EngineTensor, GroupRef, make_layout, plan_transfer  # noqa: E402
from kvd_client.dataplane.cuda import CudaBackend  # noqa: E402

PAGE = 32 << 10


def run(total_mib: int = 2048, blocks_per_chunk: int = 16, repeats: int = 5) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run this on a GPU machine")
    n = (total_mib << 20) // PAGE
    gpu = torch.empty((n, PAGE), dtype=torch.int8, device="cuda")
    host = mmap.mmap(-1, n * PAGE)          # stands in for the daemon's memfd pool
    arr = np.frombuffer(host, dtype=np.uint8)
    backend = CudaBackend(arr.ctypes.data, n * PAGE)
    t = EngineTensor(gpu.data_ptr(), PAGE, PAGE, n)
    layout = make_layout([t], [(GroupRef(0, PAGE),)], blocks_per_chunk)
    rng = np.random.default_rng(0)
    ids = rng.permutation(n).tolist()
    slots = (rng.permutation(n // blocks_per_chunk) * layout.slot_bytes).tolist()
    out: dict = {"bytes": n * PAGE, "pinned": backend.pinned}
    for name, to_pool in (("store", True), ("load", False)):
        plan = plan_transfer(layout, [t], pool_base=arr.ctypes.data, rank=0,
                             slot_offsets=slots, block_ids=ids, group_sizes=[n],
                             block_indices=[0], to_pool=to_pool)
        times = []
        for job in range(repeats):
            backend.submit(job, plan, is_store=to_pool)
            backend.wait({job})
            times.extend(d.transfer_time for d in backend.get_finished())
        out[f"{name}_gbps"] = n * PAGE / statistics.median(times) / 1e9
        out[f"{name}_runs"] = len(plan)
    pinned = torch.empty(n * PAGE, dtype=torch.int8, pin_memory=True)
    flat = gpu.view(-1)
    for name, (dst, src) in (("store_ref", (pinned, flat)), ("load_ref", (flat, pinned))):
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[f"{name}_gbps"] = n * PAGE / statistics.median(times) / 1e9
    out["store_fraction"] = out["store_gbps"] / out["store_ref_gbps"]
    out["load_fraction"] = out["load_gbps"] / out["load_ref_gbps"]
    backend.shutdown()
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
