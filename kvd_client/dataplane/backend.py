"""The copy-backend contract (vLLM's OffloadingWorker verbs) and what both backends share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from .planner import CopyPlan


@dataclass(slots=True)
class TransferDone:
    job_id: int
    success: bool
    transfer_size: int
    transfer_time: float
    is_store: bool


class CopyBackend(ABC):
    """Executes plans asynchronously; results are polled with get_finished()."""

    @abstractmethod
    def submit(self, job_id: int, plan: CopyPlan, *, is_store: bool,
               expedited: bool = False) -> bool: ...

    @abstractmethod
    def get_finished(self) -> list[TransferDone]: ...

    @abstractmethod
    def wait(self, job_ids: set[int]) -> None: ...

    def add_region(self, base: int, size: int) -> None:  # noqa: B027
        """A pool mapping plans may address from now on (the GPU backend registers it for
        DMA in the background); host memory needs nothing."""

    def remove_region(self, base: int) -> None:  # noqa: B027
        """The mapping at `base` goes away: finish what touches it and release it."""

    def shutdown(self) -> None:  # noqa: B027
        """Release streams/threads."""
