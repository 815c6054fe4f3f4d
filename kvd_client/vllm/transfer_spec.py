"""The LoadStoreSpec kvd's scheduler side hands to its workers (picklable, small)."""

from __future__ import annotations

import numpy as np
from vllm.v1.kv_offload.base import LoadStoreSpec


class KvdSlotsSpec(LoadStoreSpec):
    """Pool offsets of the chunks of one transfer, in vLLM's chunk order (group after group).

    A SKIP (-1) offset means "not transferred" (a store the daemon declined). Store specs are
    created empty in prepare_store and filled in on_schedule_end, before vLLM serialises them
    to the workers. `pool_id` names the pool the offsets belong to.
    """

    def __init__(self, offsets: list[int] | np.ndarray, pool_id: str) -> None:
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.pool_id = pool_id

    def __repr__(self) -> str:
        return f"KvdSlotsSpec({self.offsets.tolist()}, pool={self.pool_id})"
