"""A namespace's "held below" table as the daemon writes it (kvd_proto/below_layout.py).

Engines read it lock-free on the scheduler thread: a key their index lookup misses but this
table names is answered HIT_PENDING and promoted. The daemon writes it on its event loop only
(no lock): a fingerprint goes in when a tier holds the key (written, or found at the tier's
start) and out when no tier does. Each bucket is one aligned 8-byte store, so a reader sees a
fingerprint whole or not at all.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import Any

from kvd_proto.below_layout import MAX_PROBE, BelowHeader, buckets_for
from kvd_proto.native import below_flags_view, below_view, key_fingerprint, probe_below
from kvd_server.memory.shm_index import sealed_shared_file
from kvd_server.tiers.base import Tier, TierKey
from kvd_server.tiers.disk.space import aligned


class BelowTable:
    """One namespace's table: a sealed memfd (`fd`, handed to engines), mapped here writable."""

    def __init__(self, name: str, max_keys: int) -> None:
        header = BelowHeader(buckets_for(max_keys))
        self.fd, self._map = sealed_shared_file(f"kvd-below-{name}", header.file_bytes)
        self._map[:len(header.pack())] = header.pack()
        self._buckets: Any
        self._buckets, self._mask = below_view(self._map, writable=True)
        self._flags = below_flags_view(self._map, writable=True)
        self.file_bytes = header.file_bytes
        self.count = 0

    @property
    def flags(self) -> int:
        """What engines do with a key neither the index nor this table names
        (kvd_proto/below_layout.py: FLAG_ASK, FLAG_WAIT)."""
        return int(self._flags[0])

    @flags.setter
    def flags(self, value: int) -> None:
        if self._flags[0] != value:
            self._flags[0] = value           # one aligned 4-byte store: read whole

    def __contains__(self, key: bytes) -> bool:
        return probe_below(self._buckets, self._mask, key_fingerprint(key)) >= 0

    def add(self, key: bytes) -> bool:
        """Name `key` as held below; False when its probe run is full (left out)."""
        fp = key_fingerprint(key)
        buckets, mask = self._buckets, self._mask
        b = fp & mask
        for _ in range(MAX_PROBE):
            v = buckets[b]
            if v == fp:
                return True             # held already (or a key sharing its fingerprint)
            if not v:
                buckets[b] = fp
                self.count += 1
                return True
            b = (b + 1) & mask
        # Left out: engines read MISS for it (the stats' `below_keys` then falls short of
        # the tier's `blocks`).
        return False

    def discard(self, key: bytes) -> None:
        """`key` is held below no more (two keys sharing a fingerprint lose it together:
        the other one reads MISS, never a wrong block)."""
        hole = probe_below(self._buckets, self._mask, key_fingerprint(key))
        if hole < 0:
            return
        buckets, mask = self._buckets, self._mask
        j = hole
        for _ in range(mask + 1):      # backward-shift deletion, as the index's
            j = (j + 1) & mask
            v = buckets[j]
            if not v:
                break
            home = v & mask
            if (hole < j and hole < home <= j) or (hole > j and (home > hole or home <= j)):
                continue
            buckets[hole] = v
            hole = j
        buckets[hole] = 0
        self.count -= 1

    def clear(self) -> None:
        buckets = self._buckets
        zeros = bytes(8 * min(len(buckets), 1 << 17))
        with buckets.cast("B") as raw:
            for start in range(0, len(raw), len(zeros)):
                end = min(len(raw), start + len(zeros))
                raw[start:end] = zeros[:end - start]
        self.count = 0

    def close(self) -> None:
        self._buckets.release()
        self._flags.release()
        with contextlib.suppress(BufferError):
            self._map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BelowTables:
    """Every namespace's table over one tier (event loop only)."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self._tables: dict[str, BelowTable] = {}

    def get(self, ns_id: str) -> BelowTable | None:
        return self._tables.get(ns_id)

    def join(self, ns_id: str, block_bytes: int) -> BelowTable:
        """The namespace's table, made with room for as many of its blocks as the tier
        holds, and filled with what the tier holds of it already."""
        table = self._tables.get(ns_id)
        if table is None:
            capacity = self.tier.stats().capacity_bytes
            table = BelowTable(ns_id[:16], capacity // max(1, aligned(block_bytes)))
            self._tables[ns_id] = table
            self.fill(ns_id)
        return table

    def fill(self, ns_id: str) -> None:
        table = self._tables.get(ns_id)
        if table is not None:
            for key in self.tier.keys(ns_id):
                table.add(key)

    def fill_all(self) -> None:
        """The tier opened: name what it held from before."""
        for ns_id in list(self._tables):
            self.fill(ns_id)

    def held(self, keys: Iterable[TierKey]) -> None:
        """Written blocks (told from the I/O threads, so checked: a reset or an eviction
        since may have dropped them)."""
        for k in keys:
            table = self._tables.get(k.namespace)
            if table is not None and self.tier.contains(k):
                table.add(k.key)

    def lost(self, keys: Iterable[TierKey]) -> None:
        for k in keys:
            table = self._tables.get(k.namespace)
            if table is not None:
                table.discard(k.key)

    def clear(self, ns_id: str) -> None:
        table = self._tables.get(ns_id)
        if table is not None:
            table.clear()

    def clear_all(self) -> None:
        """Name nothing (the tier cannot be read now); `fill_all` names it again."""
        for table in self._tables.values():
            table.clear()

    def forget(self, ns_id: str) -> None:
        table = self._tables.pop(ns_id, None)
        if table is not None:
            table.close()

    @property
    def keys_named(self) -> int:
        return sum(t.count for t in self._tables.values())

    def close(self) -> None:
        for ns_id in list(self._tables):
            self.forget(ns_id)
