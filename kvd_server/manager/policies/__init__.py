"""Eviction policies by name."""

from __future__ import annotations

from typing import Any

from kvd_server.policy_names import ARC, LRU

from ..blocks import BlockTable
from .arc import ARCPolicy
from .base import Policy, RequestState
from .lru import LRUPolicy

POLICIES: dict[str, type[Policy]] = {LRU: LRUPolicy, ARC: ARCPolicy}


def make_policy(name: str, capacity: int, table: BlockTable,
                memory: Any = None) -> Policy:
    """Instantiate the policy called `name` (one of kvd_server.policy_names). `memory`: a
    writable buffer for its per-slot order that outlives the daemon (warm restart: LRU keeps
    its ranks there, so a restarted daemon evicts in the same order); None: its own."""
    try:
        cls = POLICIES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of: {', '.join(POLICIES)}"
        ) from None
    if memory is not None and cls is LRUPolicy:
        return LRUPolicy(capacity, table, ranks=memory)
    return cls(capacity, table)


__all__ = ["ARCPolicy", "LRUPolicy", "POLICIES", "Policy", "RequestState", "make_policy"]
