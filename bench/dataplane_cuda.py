"""GPU data plane: kvd's planner + CUDA backend against one large pinned copy, per page size,
direction and copy method; CPU cost of submitting; how fast a worker is ready on a big pool.

Run on a GPU machine: `python bench/dataplane_cuda.py [--pages 16,32,64,2048] [--out FILE]`
(writes bench/results/gpu.json). Every transfer is timed by its own completion: the CUDA
events the backend records around it on its stream. The baseline, one large copy between a
pinned buffer and the GPU, is timed the same way in the same run. Without CUDA it says so and
exits with status 0 (it is not part of `make bench`).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
OUT = Path(__file__).resolve().parent / "results" / "gpu.json"


def no_cuda_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    return None


def make_pool(size: int) -> tuple[mmap.mmap, np.ndarray]:
    """A shared, pre-faulted memfd mapping: what the daemon hands a worker."""
    fd = os.memfd_create("kvd-bench-pool")
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    arr = np.frombuffer(m, dtype=np.uint8)
    arr[::mmap.PAGESIZE] = 0                     # fault every page in, as the daemon does
    return m, arr


def timed_copy(torch: Any, dst: Any, src: Any, repeats: int) -> float:
    """Median GB/s of one large copy, timed by events on a side stream."""
    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return src.numel() * src.element_size() / statistics.median(times) / 1e9


def bench_page(torch: Any, page: int, method: str, total: int, repeats: int, blocks: int,
               pool: np.ndarray) -> dict[str, Any]:
    from kvd_client.dataplane import EngineTensor, GroupRef, make_layout, plan_transfer
    from kvd_client.dataplane.cuda import CudaBackend
    from kvd_client.dataplane.options import CopyOptions

    n = total // page
    bpc = 16 if page <= 64 * KIB else 1
    src = torch.randint(0, 256, (n, page), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    options = CopyOptions.from_config({"kvd_copy_backend": method, "kvd_copy_blocks": blocks},
                                      {})
    try:
        backend = CudaBackend(options)
    except ValueError as exc:
        return {"page_bytes": page, "method": method, "unavailable": str(exc)}
    base = pool.ctypes.data
    backend.add_region(base, pool.size)
    backend.warm_up(600)
    rng = np.random.default_rng(page)
    ids = rng.permutation(n)
    out: dict[str, Any] = {"page_bytes": page, "method": method, "bytes": n * page,
                           "chain": [m.value for m in backend.chain.methods]}
    for name, tensor, to_pool in (("store", src, True), ("load", dst, False)):
        t = EngineTensor(tensor.data_ptr(), page, page, n)
        layout = make_layout([t], [(GroupRef(0, page),)], bpc)
        slots = (np.random.default_rng(1).permutation(n // bpc) * layout.slot_bytes)
        started = time.perf_counter()
        plan = plan_transfer(layout, [t], pool_base=base, rank=0, slot_offsets=slots,
                             block_ids=ids if to_pool else ids[::-1].copy(),
                             group_sizes=[n], block_indices=[0], to_pool=to_pool)
        plan_s = time.perf_counter() - started
        times, submit = [], []
        for job in range(repeats):
            before = backend.submit_seconds
            backend.submit(job, plan, is_store=to_pool)
            submit.append(backend.submit_seconds - before)
            backend.wait({job})
            (done,) = backend.get_finished()
            assert done.success
            times.append(done.transfer_time)
        scale = 4 * GIB / (n * page)
        out[name] = {"gbps": n * page / statistics.median(times) / 1e9, "runs": len(plan),
                     "submit_ms_per_4gib": statistics.median(submit) * scale * 1e3,
                     "plan_ms_per_4gib": plan_s * scale * 1e3,
                     "methods": {m.value: c for m, c in backend.method_counts.items()}}
        backend.method_counts.clear()
    torch.cuda.synchronize()
    # stored src[ids[i]] went to slot i; the load put slot i into dst[ids[::-1][i]]
    index = torch.from_numpy(ids).cuda()
    out["roundtrip_exact"] = bool(torch.equal(dst[index.flip(0)], src[index]))
    backend.shutdown()
    return out


def bench_ready(torch: Any, pool_gib: int, chunk_mib: int) -> dict[str, Any]:
    """A worker on a `pool_gib` pool: time from backend creation to ready (mapped region
    handed over), the first transfer (before registration), and registration per GiB."""
    from kvd_client.dataplane import EngineTensor, GroupRef, make_layout, plan_transfer
    from kvd_client.dataplane.cuda import CudaBackend
    from kvd_client.dataplane.options import CopyOptions

    m, pool = make_pool(pool_gib * GIB)
    try:
        started = time.perf_counter()
        backend = CudaBackend(CopyOptions.from_config({"kvd_pin_chunk_mib": chunk_mib}, {}))
        backend.add_region(pool.ctypes.data, pool.size)
        ready = time.perf_counter() - started
        page, n = 64 * KIB, 1024                      # 64 MiB at the far end of the pool
        src = torch.randint(0, 256, (n, page), dtype=torch.uint8, device="cuda")
        t = EngineTensor(src.data_ptr(), page, page, n)
        layout = make_layout([t], [(GroupRef(0, page),)], 16)
        far = pool.size - n * page
        plan = plan_transfer(layout, [t], pool_base=pool.ctypes.data, rank=0,
                             slot_offsets=[far + i * layout.slot_bytes for i in range(n // 16)],
                             block_ids=list(range(n)), group_sizes=[n], block_indices=[0],
                             to_pool=True)
        backend.submit(0, plan, is_store=True)
        backend.wait({0})
        (first,) = backend.get_finished()
        first_s = time.perf_counter() - started
        settled = backend.warm_up(3600)
        registered = backend.pinner.registered_bytes
        out = {"pool_gib": pool_gib, "chunk_mib": chunk_mib, "ready_seconds": ready,
               "first_transfer_done_seconds": first_s,
               "first_transfer_methods": {k.value: v for k, v in
                                          backend.method_counts.items()},
               "first_transfer_ok": first.success, "registration_settled": settled,
               "registered_gib": registered / GIB,
               "registration_seconds": backend.pinner.register_seconds,
               "registration_seconds_per_gib": backend.pinner.register_seconds
               / max(registered / GIB, 1e-9)}
        backend.shutdown()
        return out
    finally:
        del pool
        m.close()


def machine(torch: Any) -> dict[str, Any]:
    from kvd_client.dataplane.cudadrv import CudaDriver

    info: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "host": platform.node(),
                            "cpu": platform.processor() or platform.machine(),
                            "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                            "cuda_driver_api": CudaDriver().version()}
    try:
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except ImportError:
        info["cupy"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", default="16,32,64,2048", help="page sizes in KiB")
    ap.add_argument("--methods", default="auto,kernel,batch,loop")
    ap.add_argument("--total-mib", type=int, default=2048, help="bytes moved per transfer")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=16, help="kernel thread blocks")
    ap.add_argument("--ready-pool-gib", type=int, default=64, help="0 skips that part")
    ap.add_argument("--pin-chunk-mib", type=int, default=256)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    reason = no_cuda_reason()
    if reason is not None:
        print(f"bench/dataplane_cuda.py: {reason}; run it on a GPU machine. Nothing written.")
        return 0
    import torch

    total = args.total_mib * MIB
    m, pool = make_pool(total)
    flat = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    ref = {"store_gbps": timed_copy(torch, pinned, flat, args.repeats),
           "load_gbps": timed_copy(torch, flat, pinned, args.repeats)}
    del flat, pinned
    results = []
    for kib in (int(x) for x in args.pages.split(",")):
        for method in args.methods.split(","):
            r = bench_page(torch, kib * KIB, method, total, args.repeats, args.blocks, pool)
            for d in ("store", "load"):
                if d in r:
                    r[d]["fraction_of_pinned_copy"] = r[d]["gbps"] / ref[f"{d}_gbps"]
            results.append(r)
            print(json.dumps(r), flush=True)
    del pool
    m.close()
    ready = bench_ready(torch, args.ready_pool_gib, args.pin_chunk_mib) \
        if args.ready_pool_gib else None
    best = [r for r in results if r["method"] == "auto" and "store" in r]
    doc = {
        "machine": machine(torch),
        "settings": vars(args) | {"out": str(args.out)},
        "pinned_copy": ref,
        "pages": results,
        "ready": ready,
        "targets": {
            "ge_90pct_of_pinned_copy_every_page_both_directions": bool(best) and all(
                r[d]["fraction_of_pinned_copy"] >= 0.9 for r in best for d in ("store", "load")),
            "le_1ms_cpu_submit_per_4gib": bool(best) and all(
                r[d]["submit_ms_per_4gib"] <= 1.0 for r in best for d in ("store", "load")),
            "ready_le_1s": None if ready is None else ready["ready_seconds"] <= 1.0,
            "roundtrips_exact": all(r.get("roundtrip_exact", True) for r in results),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc["targets"], indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
