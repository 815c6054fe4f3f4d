"""One GPU data-plane transfer as a separate engine-worker process would do it.

`python -m tests.gpu.scenario store|load RANK SPEC_JSON` maps the daemon's pool (a data-plane
attach), fills this rank's GPU KV tensors (a store: a pattern fixed by the seed; a load: a
sentinel), runs the planned transfer through kvd's CUDA backend with the method the spec
forces, and prints one JSON line. A load compares every byte of its GPU tensors with the CPU
backend running the same plan against the same pool: loaded blocks must match, all others
must still hold the sentinel.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

SENTINEL = 0xEE


@dataclass
class Scenario:
    socket: str
    rows: list[int]                       # bytes per block, per tensor
    num_blocks: int
    refs: list[list[list[int]]]           # per group: [tensor index, bytes copied per block]
    blocks_per_chunk: int
    num_ranks: int
    offsets: list[int]                    # slot offsets, SKIP (-1) for chunks left alone
    group_sizes: list[int]
    block_indices: list[int]
    store_ids: list[int]
    load_ids: list[int]
    method: str = "auto"                  # auto | kernel | batch | loop
    seed: int = 0
    hold_pinning: bool = False            # first transfer before any chunk is registered
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def pattern(s: Scenario, rank: int, tensor: int) -> np.ndarray:
    rng = np.random.default_rng([s.seed, rank, tensor])
    return rng.integers(0, 256, size=(s.num_blocks, s.rows[tensor]), dtype=np.uint8)


def layout_and_tensors(s: Scenario, bases: list[int]) -> tuple[Any, list[Any]]:
    from kvd_client.dataplane import EngineTensor, GroupRef, make_layout

    tensors = [EngineTensor(base, row, row, s.num_blocks) for base, row in zip(bases, s.rows)]
    refs = [tuple(GroupRef(t, n) for t, n in group) for group in s.refs]
    return make_layout(tensors, refs, s.blocks_per_chunk, s.num_ranks), tensors


def plan(s: Scenario, bases: list[int], pool_base: int, rank: int, to_pool: bool) -> Any:
    from kvd_client.dataplane import plan_transfer

    layout, tensors = layout_and_tensors(s, bases)
    return plan_transfer(layout, tensors, pool_base=pool_base, rank=rank,
                         slot_offsets=s.offsets,
                         block_ids=s.store_ids if to_pool else s.load_ids,
                         group_sizes=s.group_sizes, block_indices=s.block_indices,
                         to_pool=to_pool)


def expected_pool(s: Scenario, before: np.ndarray) -> np.ndarray:
    """The pool after every rank's store, computed by the CPU backend."""
    from kvd_client.dataplane.cpu import CpuBackend

    out = before.copy()
    for rank in range(s.num_ranks):
        host = [pattern(s, rank, t) for t in range(len(s.rows))]
        CpuBackend().submit(0, plan(s, [h.ctypes.data for h in host], out.ctypes.data, rank,
                                    True), is_store=True)
    return out


def _run(action: str, rank: int, s: Scenario) -> dict[str, Any]:
    import torch

    from kvd_client.client import attach_dataplane
    from kvd_client.dataplane.cpu import CpuBackend
    from kvd_client.dataplane.cuda import CudaBackend
    from kvd_client.dataplane.options import CopyOptions

    to_pool = action == "store"
    if to_pool:
        host = [pattern(s, rank, t) for t in range(len(s.rows))]
    else:
        host = [np.full((s.num_blocks, row), SENTINEL, dtype=np.uint8) for row in s.rows]
    gpu = [torch.from_numpy(h).cuda() for h in host]
    _, mapping = attach_dataplane(s.socket, timeout=5)
    pool = mapping.numpy(0, mapping.size)
    options = CopyOptions.from_config({"kvd_copy_backend": s.method, **s.extra}, {})
    try:
        backend = CudaBackend(options, device=0)
    except ValueError as exc:                      # a forced method this machine lacks
        return {"ok": False, "unavailable": str(exc)}
    gate = threading.Event()
    if s.hold_pinning:
        register = backend.pinner._register
        backend.pinner._register = lambda a, n: (gate.wait(60), register(a, n))[1]
    backend.add_region(pool.ctypes.data, mapping.size)
    if not s.hold_pinning:
        backend.warm_up(120)
    p = plan(s, [t.data_ptr() for t in gpu], pool.ctypes.data, rank, to_pool)
    methods, submit_s = [], []
    for job in range(2 if s.hold_pinning else 1):
        before = dict(backend.method_counts)
        started = time.perf_counter()
        backend.submit(job, p, is_store=to_pool)
        submit_s.append(time.perf_counter() - started)
        backend.wait({job})
        torch.cuda.synchronize()
        done = backend.get_finished()
        if not all(d.success for d in done) or len(done) != 1:
            return {"ok": False, "error": f"transfer failed: {done}"}
        methods += [m.value for m, n in backend.method_counts.items() if n > before.get(m, 0)]
        if s.hold_pinning:
            gate.set()
            if not backend.warm_up(120):
                return {"ok": False, "error": "pool never registered"}
    result: dict[str, Any] = {"ok": True, "methods": methods, "bytes": p.total_bytes,
                              "runs": len(p), "submit_s": submit_s,
                              "chain": [m.value for m in backend.chain.methods]}
    if not to_pool:
        expect = [np.full((s.num_blocks, row), SENTINEL, dtype=np.uint8) for row in s.rows]
        CpuBackend().submit(0, plan(s, [e.ctypes.data for e in expect], pool.ctypes.data,
                                    rank, False), is_store=False)
        got = [g.cpu().numpy() for g in gpu]
        bad_rows = [np.nonzero((g != e).any(axis=1))[0] for g, e in zip(got, expect)]
        result["mismatched_blocks"] = int(sum(r.size for r in bad_rows))
        result["wrong_bytes"] = int(sum(int((g != e).sum()) for g, e in zip(got, expect)))
        loaded = int(sum(int((e != SENTINEL).any(axis=1).sum()) for e in expect))
        result["loaded_blocks"] = loaded
    backend.shutdown()
    del pool
    mapping.close()
    return result


def main(argv: list[str]) -> int:
    action, rank, spec = argv[0], int(argv[1]), Scenario(**json.loads(argv[2]))
    try:
        result = _run(action, rank, spec)
    except Exception as exc:  # noqa: BLE001 - report, do not hang the parent on a traceback
        import traceback

        result = {"ok": False, "error": f"{exc!r}\n{traceback.format_exc()}"}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
