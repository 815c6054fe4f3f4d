"""Eviction policies by name."""

from __future__ import annotations

from .arc import ARCPolicy
from .base import Block, Policy, RequestState
from .lru import LRUPolicy

POLICIES: dict[str, type[Policy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> Policy:
    """Instantiate the policy called `name` ("lru" or "arc")."""
    try:
        cls = POLICIES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of: {', '.join(POLICIES)}"
        ) from None
    return cls(capacity)


__all__ = ["ARCPolicy", "Block", "LRUPolicy", "POLICIES", "Policy", "RequestState", "make_policy"]
