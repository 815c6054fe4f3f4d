"""The data plane: the fragment planner and the copy backends (cpu, cuda)."""

from .planner import SKIP, CopyPlan, chunks_for_group, coalesce, plan_transfer
from .slot_layout import EngineTensor, GroupRef, SlotLayout, make_layout

__all__ = ["SKIP", "CopyPlan", "EngineTensor", "GroupRef", "SlotLayout", "chunks_for_group",
           "coalesce", "make_layout", "plan_transfer"]
