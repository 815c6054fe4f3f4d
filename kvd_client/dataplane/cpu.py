"""CPU copy backend: engine KV tensors in host memory (tests, CPU engines).

Copies run at submission (memmove per coalesced run: the plan is already merged, so the loop is
over runs, not blocks); completion and timing are reported through get_finished() exactly like
the CUDA backend, so the engine-side code paths are the same.
"""

from __future__ import annotations

import ctypes
import time
from collections import deque

from .backend import CopyBackend, TransferDone
from .planner import CopyPlan


def execute(plan: CopyPlan) -> None:
    move = ctypes.memmove
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist(), strict=True):
        move(d, s, n)


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
