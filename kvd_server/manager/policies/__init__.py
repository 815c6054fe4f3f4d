"""Eviction policies by name."""

from __future__ import annotations

from kvd_server.policy_names import ARC, LRU

from ..blocks import BlockTable
from .arc import ARCPolicy
from .base import Policy, RequestState
from .lru import LRUPolicy

POLICIES: dict[str, type[Policy]] = {LRU: LRUPolicy, ARC: ARCPolicy}


def make_policy(name: str, capacity: int, table: BlockTable) -> Policy:
    """Instantiate the policy called `name` (one of kvd_server.policy_names)."""
    try:
        cls = POLICIES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of: {', '.join(POLICIES)}"
        ) from None
    return cls(capacity, table)


__all__ = ["ARCPolicy", "LRUPolicy", "POLICIES", "Policy", "RequestState", "make_policy"]
