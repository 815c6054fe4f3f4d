"""Eviction policies by name."""

from __future__ import annotations

from ..blocks import BlockTable
from .arc import ARCPolicy
from .base import Policy, RequestState
from .lru import LRUPolicy

POLICIES: dict[str, type[Policy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int, table: BlockTable) -> Policy:
    """Instantiate the policy called `name` ("lru" or "arc")."""
    try:
        cls = POLICIES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of: {', '.join(POLICIES)}"
        ) from None
    return cls(capacity, table)


__all__ = ["ARCPolicy", "LRUPolicy", "POLICIES", "Policy", "RequestState", "make_policy"]
