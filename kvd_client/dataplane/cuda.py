"""CUDA copy backend: pinned DMA between GPU KV blocks and the mapped pool.

Import-guarded: this module imports on a machine without CUDA; constructing a backend checks
for a GPU and fails with a clear message. Plans come from the same planner the CPU backend uses;
only the final copy calls differ. Transfers run on pooled streams ordered after the engine's
current stream (the KV they read must be written; loads must follow block zeroing) and, per
direction, after the previous transfer; CUDA events time them.
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from .backend import CopyBackend, TransferDone
from .planner import CopyPlan

log = logging.getLogger(__name__)

REGISTER_CHUNK = 64 << 30       # cudaHostRegister at most 64 GiB per call
_MEMCPY_DEFAULT = 4             # cudaMemcpyDefault: direction from unified addressing


def _torch() -> Any:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the cuda backend needs a CUDA GPU; use the cpu backend")
    return torch


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch already loaded (so versions match)."""
    import torch

    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
    import glob
    import os

    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for path in glob.glob(os.path.join(lib_dir, "..", "..", "nvidia", "*", "lib",
                                       "libcudart.so*")):
        return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    raise RuntimeError("libcudart not found")


def register_host_memory(address: int, size: int) -> bool:
    """Pin [address, address+size) for DMA in <= 64 GiB pieces; False (logged) on failure."""
    rt = _cudart()
    done = 0
    while done < size:
        n = min(REGISTER_CHUNK, size - done)
        rc = rt.cudaHostRegister(ctypes.c_void_p(address + done), ctypes.c_size_t(n),
                                 ctypes.c_uint(0))
        if rc != 0:
            log.warning("cudaHostRegister of the pool failed (error %d) after %d bytes; copies "
                        "use pageable memory and run slower", rc, done)
            while done > 0:
                piece = min(REGISTER_CHUNK, done)
                done -= piece
                rt.cudaHostUnregister(ctypes.c_void_p(address + done))
            return False
        done += n
    return True


@dataclass(slots=True)
class _Transfer:
    job_id: int
    is_store: bool
    size: int
    stream: Any
    start: Any
    end: Any


class CudaBackend(CopyBackend):
    def __init__(self, pool_address: int, pool_size: int, device: int | None = None) -> None:
        self.torch = _torch()
        self.rt = _cudart()
        self.device = device if device is not None else self.torch.cuda.current_device()
        self.pinned = register_host_memory(pool_address, pool_size)
        self._pool = (pool_address, pool_size)
        self._queues: dict[str, deque[_Transfer]] = {"store": deque(), "load": deque(),
                                                     "expedited": deque()}
        self._streams: list[Any] = []
        self._events: list[Any] = []
        self._memcpy = self.rt.cudaMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.c_int, ctypes.c_void_p]

    def submit(self, job_id: int, plan: CopyPlan, *, is_store: bool,
               expedited: bool = False) -> bool:
        torch = self.torch
        kind = "store" if is_store else ("expedited" if expedited else "load")
        queue = self._queues[kind]
        stream = self._streams.pop() if self._streams else torch.cuda.Stream(self.device)
        start = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
        end = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if queue:
            stream.wait_event(queue[-1].end)
        handle = ctypes.c_void_p(stream.cuda_stream)
        with torch.cuda.stream(stream):
            start.record(stream)
            for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist(),
                               strict=True):
                rc = self._memcpy(d, s, n, _MEMCPY_DEFAULT, handle)
                if rc != 0:
                    raise RuntimeError(f"cudaMemcpyAsync failed with error {rc}")
            end.record(stream)
        queue.append(_Transfer(job_id, is_store, plan.total_bytes, stream, start, end))
        return True

    def get_finished(self) -> list[TransferDone]:
        out = []
        for queue in self._queues.values():
            while queue and queue[0].end.query():
                t = queue.popleft()
                seconds = t.start.elapsed_time(t.end) / 1000.0
                out.append(TransferDone(t.job_id, True, t.size, seconds, t.is_store))
                self._streams.append(t.stream)
                self._events.extend((t.start, t.end))
        return out

    def wait(self, job_ids: set[int]) -> None:
        for queue in self._queues.values():
            for t in queue:
                if t.job_id in job_ids:
                    t.end.synchronize()

    def shutdown(self) -> None:
        for queue in self._queues.values():
            for t in queue:
                t.end.synchronize()
        if self.pinned:
            address, size = self._pool
            done = 0
            while done < size:
                self.rt.cudaHostUnregister(ctypes.c_void_p(address + done))
                done += REGISTER_CHUNK
            self.pinned = False
