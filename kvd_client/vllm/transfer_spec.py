"""The LoadStoreSpec kvd's scheduler side hands to its workers (picklable, small)."""

from __future__ import annotations

import numpy as np
from vllm.v1.kv_offload.base import LoadStoreSpec


class KvdSlotsSpec(LoadStoreSpec):
    """Pool offsets of the chunks of one transfer, in vLLM's chunk order (group after group).

    A SKIP (-1) offset means "not transferred". `pool_id` names the pool the offsets belong
    to. Made on the scheduler thread from the session's list as it is; the workers read
    `offsets` as an int64 array, converted there (once) rather than on the scheduler.
    """

    __slots__ = ("_offsets", "pool_id")

    def __init__(self, offsets: list[int] | np.ndarray, pool_id: str) -> None:
        self._offsets = offsets
        self.pool_id = pool_id

    @property
    def offsets(self) -> np.ndarray:
        offsets = self._offsets
        if not isinstance(offsets, np.ndarray):
            offsets = self._offsets = np.asarray(offsets, dtype=np.int64)
        return offsets

    @offsets.setter
    def offsets(self, value: list[int] | np.ndarray) -> None:
        self._offsets = value

    def __getstate__(self) -> tuple[list[int] | np.ndarray, str]:
        return self._offsets, self.pool_id

    def __setstate__(self, state: tuple[list[int] | np.ndarray, str]) -> None:
        self._offsets, self.pool_id = state

    def __repr__(self) -> str:
        return f"KvdSlotsSpec({self.offsets.tolist()}, pool={self.pool_id})"
