"""The offload manager: per-namespace block index, states, ref counts and eviction policies."""

from .namespace import ManagerCounters, NamespaceManager
from .slots import FixedSlots
from .types import BlockCounts, Lookup, OffloadEvent, StoreGrant

__all__ = [
    "BlockCounts",
    "FixedSlots",
    "Lookup",
    "ManagerCounters",
    "NamespaceManager",
    "OffloadEvent",
    "StoreGrant",
]
