"""The worker side: vLLM's OffloadingWorker over kvd's data plane, in every worker process.

Each worker maps the daemon's pool (a data-plane attach: the fd, no session) and copies its
own rank's shard of each slot, or, when every rank holds the same KV (MLA; `replicated`), the
slot's one copy: rank 0 writes it (vLLM does not hand stores to the other ranks), every rank
reads it. Specs name the pool they refer to; after a daemon restart the worker attaches again
and keeps the previous mapping for transfers already planned against it. Transfer sizes and
times go to the daemon in the background (transfer_report.py), so `kvd_transfer_*` move.
"""

from __future__ import annotations

import logging

import numpy as np
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvd_client.attach import AttachError
from kvd_client.client import attach_dataplane
from kvd_client.dataplane import EngineTensor, GroupRef, SlotLayout, make_layout, plan_transfer
from kvd_client.dataplane.backend import CopyBackend
from kvd_client.dataplane.cpu import CpuBackend
from kvd_client.dataplane.options import CopyOptions
from kvd_client.pool_map import PoolMapping
from kvd_client.transfer_report import TransferReporter
from kvd_client.vllm.transfer_spec import KvdSlotsSpec

log = logging.getLogger(__name__)

MAX_MAPPINGS = 2   # the current pool and the one before a daemon restart


class KvdOffloadingWorker(OffloadingWorker):
    def __init__(self, socket_path: str, kv_caches: CanonicalKVCaches, *,
                 blocks_per_chunk: int, rank: int, world_size: int,
                 expected_shard_bytes: int, replicated: bool = False,
                 options: CopyOptions | None = None, engine_id: str = "") -> None:
        self.socket_path = socket_path
        self.rank = 0 if replicated else rank      # whose shard of a slot this worker copies
        self.replicated = replicated
        self.tensors = [
            EngineTensor(base=t.tensor.data_ptr(),
                         row_stride=t.tensor.stride(0) * t.tensor.element_size(),
                         page_bytes=t.tensor.shape[1] * t.tensor.element_size()
                         if t.tensor.ndim > 1 else t.page_size_bytes,
                         num_blocks=t.tensor.shape[0])
            for t in kv_caches.tensors
        ]
        refs = [tuple(GroupRef(r.tensor_idx, r.page_size_bytes) for r in group)
                for group in kv_caches.group_data_refs]
        self.layout: SlotLayout = make_layout(self.tensors, refs, blocks_per_chunk,
                                              1 if replicated else max(1, world_size))
        # The scheduler sized slots from vLLM's worker_kv_bytes_per_block. If this worker's
        # pages do not fit, ranks would overwrite each other's shards, and skipping the copies
        # is no way out either: vLLM 0.33's offloading API has no failed load, so a skipped load
        # would hand the model whatever the GPU blocks held. Refuse to start instead.
        if self.layout.shard_bytes > expected_shard_bytes:
            raise ValueError(
                f"kvd cannot offload this model's KV cache: a chunk of its largest KV group "
                f"needs {self.layout.shard_bytes} bytes per rank, but vLLM sized slots for "
                f"{expected_shard_bytes} (worker_kv_bytes_per_block x blocks_per_chunk). "
                "Start the engine without kvd's kv_transfer_config and report the model.")
        self._backend: CopyBackend
        gpu = next((t.tensor.device for t in kv_caches.tensors if t.tensor.is_cuda), None)
        if gpu is None:
            self._backend = CpuBackend()
        else:
            from kvd_client.dataplane.cuda import CudaBackend

            self._backend = CudaBackend(options, device=gpu.index)
        self._mappings: dict[str, tuple[PoolMapping, np.ndarray]] = {}
        self._skipped: list[TransferResult] = []   # jobs answered without a copy
        self.reporter = TransferReporter(socket_path, engine_id=engine_id)
        self._attach()

    # ----------------------------------------------------------- pool mapping
    def _attach(self) -> str | None:
        try:
            info, mapping = attach_dataplane(self.socket_path)
        except AttachError as exc:
            log.warning("kvd worker could not attach to %s: %s", self.socket_path, exc.message)
            return None
        if info.pool_id in self._mappings:
            mapping.close()
            return info.pool_id
        while len(self._mappings) >= MAX_MAPPINGS:
            old_id = next(iter(self._mappings))
            old, old_array = self._mappings.pop(old_id)
            self._backend.remove_region(int(old_array.ctypes.data))
            old.close()
        array = mapping.numpy(0, mapping.size)
        self._mappings[info.pool_id] = (mapping, array)
        self._backend.add_region(int(array.ctypes.data), mapping.size)
        return info.pool_id

    def _pool_base(self, pool_id: str) -> int | None:
        entry = self._mappings.get(pool_id)
        if entry is None and pool_id and self._attach() == pool_id:
            entry = self._mappings.get(pool_id)
        return None if entry is None else int(entry[1].ctypes.data)

    # ---------------------------------------------------------- transfers
    def _submit(self, job_id: int, gpu: GPULoadStoreSpec, host: LoadStoreSpec,
                *, to_pool: bool, expedited: bool) -> bool:
        if not isinstance(host, KvdSlotsSpec):
            log.error("kvd worker: job %d has a %s, not a KvdSlotsSpec; failed", job_id,
                      type(host).__name__)
            self._skipped.append(TransferResult(job_id, False, 0, 0.0))
            return True
        base = self._pool_base(host.pool_id)
        if base is None or not (host.offsets >= 0).any():
            if not to_pool and (host.offsets >= 0).any():
                log.error("kvd worker: load job %d names pool %s which is not mapped; "
                          "its blocks are not loaded", job_id, host.pool_id)
            self._skipped.append(TransferResult(job_id, True, 0, 0.0))
            return True
        try:
            plan = plan_transfer(self.layout, self.tensors, pool_base=base, rank=self.rank,
                                 slot_offsets=host.offsets, block_ids=gpu.block_ids,
                                 group_sizes=gpu.group_sizes, block_indices=gpu.block_indices,
                                 to_pool=to_pool)
            return self._backend.submit(job_id, plan, is_store=to_pool, expedited=expedited)
        except Exception:
            # OffloadingWorker's contract: a transfer that cannot run is a failed job reported
            # by get_finished, never an exception out of submit.
            log.exception("kvd worker: %s job %d failed", "store" if to_pool else "load",
                          job_id)
            self._skipped.append(TransferResult(job_id, False, 0, 0.0))
            return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, to_pool=True, expedited=False)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        return self._submit(job_id, dst_spec, src_spec, to_pool=False, expedited=expedited)

    def get_finished(self) -> list[TransferResult]:
        out, self._skipped = self._skipped, []
        for d in self._backend.get_finished():
            out.append(TransferResult(d.job_id, d.success, d.transfer_size, d.transfer_time))
            if d.success and d.transfer_size:
                self.reporter.record(is_store=d.is_store, size=d.transfer_size,
                                     seconds=d.transfer_time)
        return out

    def wait(self, job_ids: set[int]) -> None:
        self._backend.wait(job_ids)

    def shutdown(self) -> None:
        self._backend.shutdown()
        self.reporter.close()
        for mapping, _ in self._mappings.values():
            mapping.close()
        self._mappings.clear()
