"""CPU copy backend: engine KV tensors in host memory (tests, CPU engines), and the host to
host copies of SGLang's pages (kvd_client/sglang/pages.py).

Copies run at submission, one call over the plan's coalesced runs (the plan is already merged,
so the loop is over runs, not blocks): compiled where built (kvd_client/dataplane/_copy.c:
the GIL released, large calls streamed past the cache), else `py_execute`, its twin (a
ctypes.memmove per run: the same bytes). `KVD_NATIVE=0` forces the twin. Completion and
timing are reported through get_finished() exactly like the CUDA backend, so the engine-side
code paths are the same.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import deque

import numpy as np

from kvd_proto.native import compiled

from .backend import CopyBackend, TransferDone
from .planner import CopyPlan

_copy = compiled("kvd_client.dataplane._copy")


MAX_COPY_THREADS = 16


def py_execute(plan: CopyPlan, threads: int = 1) -> None:
    """The Python twin of the compiled copy: each run moved with ctypes.memmove, in this
    thread (`threads` checked, then not used: the same bytes)."""
    if not 1 <= threads <= MAX_COPY_THREADS:
        raise ValueError(f"copy_runs: threads must be 1..{MAX_COPY_THREADS}")
    move = ctypes.memmove
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist(), strict=True):
        move(d, s, n)


def execute(plan: CopyPlan, threads: int = 1) -> None:
    """Move every run of `plan` (compiled where built, else `py_execute`). `threads` (1..16):
    how many threads a large call is shared among (kvd_client/dataplane/_copy.c)."""
    if _copy is None:
        py_execute(plan, threads)
        return
    words = np.ascontiguousarray
    _copy.copy_runs(words(plan.src, np.int64), words(plan.dst, np.int64),
                    words(plan.lengths, np.int64), threads)


def default_copy_threads() -> int:
    """Threads a large host to host copy is shared among by default: the CPUs this process
    may run on, up to 4 (memory bandwidth, not the cores, bounds a copy beyond that)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


class CpuBackend(CopyBackend):
    def __init__(self) -> None:
        self._done: deque[TransferDone] = deque()

    def submit(self, job_id: int, plan: CopyPlan, *, is_store: bool,
               expedited: bool = False) -> bool:
        start = time.perf_counter()
        execute(plan)
        self._done.append(TransferDone(job_id, True, plan.total_bytes,
                                       time.perf_counter() - start, is_store))
        return True

    def get_finished(self) -> list[TransferDone]:
        out = list(self._done)
        self._done.clear()
        return out

    def wait(self, job_ids: set[int]) -> None:
        return  # every submitted job is already complete
