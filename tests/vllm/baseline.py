"""The in-process baseline: vLLM's own CPUOffloadingManager, loaded like any spec.

vLLM's CPU worker needs a GPU, so on a CPU-only machine the baseline's worker completes every
transfer at once without copying: the replay compares scheduler-side behaviour (hits, time on
the scheduler thread), which is what kvd changes.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager


class InstantWorker(OffloadingWorker):
    def __init__(self) -> None:
        self.done: list[int] = []

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        self.done.append(job_id)
        return True

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        self.done.append(job_id)
        return True

    def get_finished(self) -> list[TransferResult]:
        out = [TransferResult(j, True, 0, 0.0) for j in self.done]
        self.done.clear()
        return out

    def wait(self, job_ids: set[int]) -> None:
        return


class BaselineCPUSpec(OffloadingSpec):
    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.num_chunks = int(self.extra_config["baseline_num_chunks"])
        self.policy = str(self.extra_config.get("eviction_policy", "lru"))
        self._manager: OffloadingManager | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = CPUOffloadingManager(num_chunks=self.num_chunks,
                                                 cache_policy=self.policy,
                                                 enable_events=False)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        return InstantWorker()
