"""The eviction policies' names, apart from their classes (kvd_server/manager/policies): the
configuration checks `manager.policy` against them, and `kvd --help` must not import the
manager (numpy) to do so."""

from __future__ import annotations

LRU = "lru"
ARC = "arc"
POLICY_NAMES: tuple[str, ...] = (LRU, ARC)
