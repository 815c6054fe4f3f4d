"""CUDA copy backend: GPU KV blocks <-> the mapped pool, at the PCIe limit where it can.

Import-guarded: this module imports on a machine without CUDA; constructing a backend checks
for a GPU and fails with a clear message. Plans come from the same planner the CPU backend
uses. Per transfer:
- the copy runs on a pooled stream that waits for the engine's current stream (a store reads
  KV the model has written; a load follows block zeroing) and for the previous transfer of
  the same kind; CUDA events on that stream give completion and time;
- the method is the first of the process's fallback chain (chain.py, chosen and logged once:
  kernel -> cuMemcpyBatchAsync -> per-run cuMemcpyAsync) that can run it: the kernel only on
  pool ranges registered and addressable at their host address, the batch call only on
  registered ones, the loop anywhere (the driver stages pageable memory);
- the pool is registered chunk by chunk in the background (pinner.py), so a worker is ready
  to copy as soon as it has mapped the pool, whatever its size;
- a method that fails at run time is dropped for the process (logged once) and the transfer
  re-runs with the next one; a transfer nothing can run is reported failed after whatever
  was enqueued for it has finished.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from .backend import CopyBackend, TransferDone
from .chain import Chain, CopyMethod, DeviceCaps, choose_chain, route
from .cudadrv import ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, CudaDriver
from .kernel import KernelLauncher
from .options import CopyOptions
from .packing import grid_size, kernel_runs, table_capacity, write_table
from .pinner import Pinner
from .planner import CopyPlan

log = logging.getLogger(__name__)


def _torch() -> Any:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the cuda backend needs a CUDA GPU; use the cpu backend")
    return torch


def _cupy_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


@functools.cache
def process_chain(caps: DeviceCaps, forced: CopyMethod | None) -> Chain:
    """The fallback chain, chosen once per process (per device kind and forced method) and
    logged once."""
    chain = choose_chain(caps, forced)
    log.info("kvd GPU copies: %s%s", chain.describe(),
             f" (forced: {forced.value})" if forced else "")
    return chain


@dataclass(slots=True)
class _Transfer:
    job_id: int
    is_store: bool
    size: int
    method: CopyMethod | None     # None: nothing could run it (reported failed)
    stream: Any
    start: Any
    end: Any
    buffers: tuple[Any, ...] = ()  # staging/device table buffers held until completion


@dataclass(slots=True)
class _TableBuffers:
    """Pinned staging and device buffers for kernel tables, reused by capacity."""

    torch: Any
    device: int
    free: dict[int, list[tuple[Any, Any]]] = field(default_factory=dict)

    def acquire(self, entries: int) -> tuple[Any, Any]:
        cap = table_capacity(entries)
        pool = self.free.get(cap)
        if pool:
            return pool.pop()
        torch = self.torch
        return (torch.empty(cap, dtype=torch.int64, pin_memory=True),
                torch.empty(cap, dtype=torch.int64, device=f"cuda:{self.device}"))

    def release(self, pair: tuple[Any, Any]) -> None:
        self.free.setdefault(int(pair[0].numel()), []).append(pair)


class CudaBackend(CopyBackend):
    def __init__(self, options: CopyOptions | None = None, device: int | None = None) -> None:
        self.torch = torch = _torch()
        self.options = options or CopyOptions()
        self.device = device if device is not None else torch.cuda.current_device()
        self.driver = driver = CudaDriver()
        with torch.cuda.device(self.device):
            torch.zeros(1, device=f"cuda:{self.device}")     # the primary context exists
            self._context = context = driver.current_context()
        caps = DeviceCaps(
            kernel_compiler=_cupy_installed(),
            host_pointer_registered=driver.attribute(
                ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, self.device) == 1,
            memcpy_batch=driver.has_batch)
        self.chain = process_chain(caps, self.options.method)
        self._broken: set[CopyMethod] = set()
        self.kernel: KernelLauncher | None = None
        self._compiling: threading.Thread | None = None
        if CopyMethod.KERNEL in self.chain.methods:
            self.kernel = KernelLauncher(self.device)
            self._compiling = threading.Thread(target=self._load_kernel, name="kvd-kernel",
                                               daemon=True)
            self._compiling.start()
        self.pinner = Pinner(self.options.pin_chunk_bytes, driver.register, driver.unregister,
                             thread_init=lambda: driver.set_context(context))
        self._queues: dict[str, deque[_Transfer]] = {"store": deque(), "load": deque(),
                                                     "expedited": deque()}
        self._streams: list[Any] = []
        self._events: list[Any] = []
        self._tables = _TableBuffers(torch, self.device)
        self.method_counts: Counter[CopyMethod] = Counter()   # transfers per method
        self.submit_seconds = 0.0                            # CPU time spent in submit

    # ---------------------------------------------------------------- preparation
    def _load_kernel(self) -> None:
        assert self.kernel is not None
        try:
            self.kernel.load()
        except Exception as exc:  # noqa: BLE001 - NVRTC and the driver raise their own kinds: the chain falls back
            self._drop(CopyMethod.KERNEL, exc)

    def _drop(self, method: CopyMethod, exc: BaseException) -> None:
        if method not in self._broken:
            self._broken.add(method)
            log.warning("kvd GPU copies: %s disabled for this process (%s); using the next "
                        "method of the chain", method.value, exc)

    def warm_up(self, timeout: float) -> bool:
        """Wait until the kernel is loaded and every mapped chunk has been tried; False on
        timeout. Benchmarks and tests call this to measure one method; copies never need
        it (until then they take a slower method, with the same bytes)."""
        deadline = time.monotonic() + timeout
        if self._compiling is not None:
            self._compiling.join(timeout)
        return self.pinner.wait_settled(max(0.0, deadline - time.monotonic()))

    def add_region(self, base: int, size: int) -> None:
        self.pinner.add_region(base, size)

    def remove_region(self, base: int) -> None:
        self._drain()
        self.pinner.remove_region(base)

    # ------------------------------------------------------------------ transfers
    def _route(self, pinned: bool, direct: bool) -> CopyMethod:
        chain = Chain(tuple(m for m in self.chain.methods if m not in self._broken), ())
        kernel_ready = self.kernel is not None and self.kernel.ready
        return route(chain, pinned=pinned, direct=direct, kernel_ready=kernel_ready)

    def submit(self, job_id: int, plan: CopyPlan, *, is_store: bool,
               expedited: bool = False) -> bool:
        started = time.perf_counter()
        torch = self.torch
        self.driver.set_context(self._context)   # driver calls run in the device's context
        # Outside the mapped pool is a planning error: raised, so the worker fails the job.
        status = self.pinner.status(plan.dst if is_store else plan.src, plan.lengths)
        kind = "store" if is_store else ("expedited" if expedited else "load")
        queue = self._queues[kind]
        stream = self._streams.pop() if self._streams else torch.cuda.Stream(self.device)
        start = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
        end = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if queue:
            stream.wait_event(queue[-1].end)
        transfer = _Transfer(job_id, is_store, plan.total_bytes, None, stream, start, end)
        start.record(stream)
        if len(plan) == 0:
            transfer.method = CopyMethod.LOOP      # nothing to copy: done when ordered
        else:
            self._copy(transfer, plan, status.pinned, status.direct)
        end.record(stream)
        queue.append(transfer)
        self.submit_seconds += time.perf_counter() - started
        return True

    def _copy(self, transfer: _Transfer, plan: CopyPlan, pinned: bool, direct: bool) -> None:
        """Enqueue with the best method that works; a failing method is dropped for good and
        the next one tried (a failed enqueue left nothing running, or only copies of the same
        bytes that the next method repeats). Leaves `transfer.method` None if all fail."""
        while True:
            method = self._route(pinned, direct)
            try:
                transfer.buffers = self._enqueue(method, plan, transfer.stream)
            except Exception as exc:  # noqa: BLE001 - any method's failure moves to the next (logged)
                if method is CopyMethod.LOOP:
                    log.error("kvd GPU copies: %s job %d failed: %s",
                              "store" if transfer.is_store else "load", transfer.job_id, exc)
                    return
                self._drop(method, exc)
                continue
            transfer.method = method
            return

    def _enqueue(self, method: CopyMethod, plan: CopyPlan, stream: Any) -> tuple[Any, ...]:
        handle = int(stream.cuda_stream)
        if method is CopyMethod.KERNEL:
            assert self.kernel is not None
            src, dst, lengths = kernel_runs(plan)
            pair = self._tables.acquire(3 * lengths.size)
            staging, table = pair
            runs = write_table(src, dst, lengths, staging.numpy())
            with self.torch.cuda.stream(stream):
                table[:3 * runs].copy_(staging[:3 * runs], non_blocking=True)
            try:
                self.kernel.launch(table.data_ptr(), runs,
                                   grid_size(runs, self.options.blocks), handle)
            except BaseException:
                # The upload may be in flight: hold the buffers until the stream passes it.
                stream.synchronize()
                self._tables.release(pair)
                raise
            return (pair,)
        if method is CopyMethod.BATCH:
            self.driver.memcpy_batch(plan.src, plan.dst, plan.lengths, handle)
        else:
            self.driver.memcpy_runs(plan.src, plan.dst, plan.lengths, handle)
        return ()

    def get_finished(self) -> list[TransferDone]:
        out = []
        for queue in self._queues.values():
            while queue and queue[0].end.query():
                t = queue.popleft()
                out.append(self._finish(t))
        return out

    def _finish(self, t: _Transfer) -> TransferDone:
        seconds = t.start.elapsed_time(t.end) / 1000.0
        for pair in t.buffers:
            self._tables.release(pair)
        self._streams.append(t.stream)
        self._events.extend((t.start, t.end))
        if t.method is None:
            return TransferDone(t.job_id, False, 0, seconds, t.is_store)
        self.method_counts[t.method] += 1
        return TransferDone(t.job_id, True, t.size, seconds, t.is_store)

    def wait(self, job_ids: set[int]) -> None:
        for queue in self._queues.values():
            for t in queue:
                if t.job_id in job_ids:
                    t.end.synchronize()

    def _drain(self) -> None:
        for queue in self._queues.values():
            for t in queue:
                t.end.synchronize()

    def shutdown(self) -> None:
        self._drain()
        self.pinner.close()
        self._tables.free.clear()
