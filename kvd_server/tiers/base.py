"""The interface of a tier below the pool, shared by the disk tier and the cluster tier.

A tier is asynchronous: `demote` and `promote` return at once with a Future (or None when the
tier refuses the work now: full queue, degraded, over quota) and do their I/O on the tier's own
threads. Callers never wait for a tier on the daemon's event loop: a slow or dead tier costs
MISSes, never a stalled pool or engine.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class TierKey:
    """A block's name in every tier: its namespace (a digest of tenant, model and layout,
    kvd_server/core/namespaces.py) and its key within it. `tenant` rides along for quotas."""

    namespace: str
    key: bytes
    tenant: str = ""


class TierHealth(enum.StrEnum):
    """A str, so the stats document carries it as "ok" / "degraded"."""

    OK = "ok"
    OPENING = "opening"          # its files are being opened (at start): refuses new work
    DEGRADED = "degraded"        # I/O failed (disk full, read-only, errors): refuses new work


@dataclass(slots=True)
class TierStats:
    """A tier's counters, for `kvd stats` and Prometheus (kvd_tier_*{tier=...})."""

    name: str = ""
    health: str = TierHealth.OK
    reason: str = ""                      # why it is degraded ("" when OK)
    capacity_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    hits_total: int = 0                   # promotions that served a block
    misses_total: int = 0                 # promotions of a key the tier does not hold
    demotions_total: int = 0              # blocks written
    demoted_bytes_total: int = 0
    promotions_total: int = 0             # blocks read back and verified
    promoted_bytes_total: int = 0
    demotions_refused_total: int = 0      # queue full, degraded, over quota, too large
    store_full_total: int = 0             # puts a full store refused (the cluster tier):
                                          # that block alone, never a fault of the tier
    evictions_total: int = 0              # blocks the tier dropped for room
    corrupt_total: int = 0                # checksum mismatches: dropped, never served
    failures_total: int = 0               # I/O errors
    queue_depth: int = 0                  # demotions and promotions not finished
    promotions_open: int = 0              # into pool slots, not finished (the daemon's count)
    promotions_refused_total: int = 0     # no pool slot free for one, or too many open
    promotions_late_total: int = 0        # past their deadline: given up (engines: MISS)
    below_keys: int = 0                   # keys named to engines as held below
    finds_total: int = 0                  # keys engines asked the store about (the cluster
                                          # tier: missed by the index and held-below table)
    find_calls_total: int = 0             # batched existence calls those cost the store
    found_total: int = 0                  # keys the store held (named held below)
    write_seconds_total: float = 0.0      # time the I/O threads spent writing
    read_seconds_total: float = 0.0
    by_tenant_bytes: dict[str, int] = field(default_factory=dict)
    directory: str = ""                   # where its files are (a local tier; the cluster
                                          # tier: its master's address)
    direct_io: bool = False               # O_DIRECT (False: the filesystem has none)


def done_future(value: bool) -> Future[bool]:
    """A Future already holding `value` (a tier's answer known at once)."""
    future: Future[bool] = Future()
    future.set_result(value)
    return future


def succeeded(future: Future[bool]) -> bool:
    """Whether a finished tier Future says the block moved (not cancelled, no error, True)."""
    return not future.cancelled() and future.exception() is None and bool(future.result())


# What a tier answers a demotion of a block it holds already: one shared, finished Future (a
# Future per block is a lock and a condition made for nothing, at every eviction of a block
# that came back from the tier).
HELD_ALREADY: Future[bool] = done_future(True)


class Tier(Protocol):
    """A tier below the pool (see the module doc).

    The members without a body are what every tier does. The optional capabilities after
    them (sharing blocks between nodes, being made of several tiers) come with defaults for
    a tier of this node alone, which a tier inherits by subclassing `Tier` (DiskTier,
    ClusterTier and TierStack do): the daemon's tier machinery uses them on any tier, never
    asking whether one has them."""

    name: str
    # Told, from any thread, of blocks the tier let go of by itself (its own evictions,
    # corrupt blocks), so that their removed events go out.
    on_dropped: Callable[[list[TierKey]], None] | None

    # ------------------------------------------------- optional capabilities, defaults
    # Whether every block is handed to `publish` as it is stored, not only to `demote` when
    # the pool evicts it (the cluster tier shares blocks with other nodes as they appear).
    publishes_stored: bool = False
    # Told, from any thread, of keys to name to the engines (True) or that the tier no longer
    # holds although this node did not drop them (False: the cluster store lost them, a
    # restarted master); a tier of this node alone never calls it. Set by the daemon.
    on_named: Callable[[list[TierKey], bool], None] | None = None

    @property
    def parts(self) -> tuple[Tier, ...]:
        """The tiers this one is made of, each with its own stats and health (the daemon
        reports and publishes each): itself, or a stack's two (tiers/stack.py)."""
        return (self,)

    def join_namespace(self, namespace: str, tenant: str, block_bytes: int = 0) -> None:
        """A namespace of this daemon exists (made, or there when the tier joined), its
        blocks `block_bytes` long: a tier that reads what other nodes published starts
        watching it (and counts their bytes at that size). Nothing by default."""
        return None     # a body, so that a subclass need not define it (not abstract)

    def find_flags(self, tenant: str) -> int:
        """The held-below table's flags for a namespace of `tenant` (kvd_proto/
        below_layout.py): FLAG_ASK where engines report the keys held nowhere on this node,
        for `find` to ask the tier (the cluster store) about; 0 by default."""
        return 0

    def find(self, namespace: str, keys: Sequence[bytes]) -> Future[list[bytes]] | None:
        """Ask whether the tier holds `keys` (none of them known here yet); the Future
        holds those it does, known (`contains`) from then on. None: the tier does not look
        for keys (the default) or cannot now."""
        return None

    def publish(self, key: TierKey, data: memoryview | bytes) -> Future[bool] | None:
        """A block as it becomes readable (asked only of a tier that `publishes_stored`);
        a demotion by default (the same copy-then-write contract)."""
        return self.demote(key, data)

    @property
    def readable(self) -> bool:
        """Whether promotions are worth starting now (reads are not failing)."""

    def contains(self, key: TierKey) -> bool:
        """Whether the tier holds `key` (a block written and not dropped since)."""

    def keys(self, namespace: str) -> list[bytes]:
        """The keys of a namespace the tier holds (to name them to its engines)."""

    def demote(self, key: TierKey, data: memoryview | bytes) -> Future[bool] | None:
        """Write `data` as `key`'s block (the bytes are copied before this returns, so the
        caller's slot may be reused at once); None when refused now. The Future says whether
        the block was written."""

    def promote(self, key: TierKey, dest: memoryview) -> Future[bool] | None:
        """Read `key`'s block into the start of `dest` (at least its length: a pool slot,
        whose bytes past the block the tier may overwrite), verifying its checksum; None
        when the tier does not hold `key`. The Future says whether `dest` holds the block
        byte-exact (False: missing, corrupt or an I/O error; a corrupt block is dropped; the
        bytes of `dest` are then undefined)."""

    def remove(self, key: TierKey) -> bool:
        """Drop `key`'s block; whether it was held."""

    def remove_namespace(self, namespace: str) -> int:
        """Drop every block of a namespace (a reset); how many."""

    def stats(self) -> TierStats:
        """A snapshot of the counters."""

    def close(self) -> None:
        """Finish the I/O in flight, persist the index, let go of the files."""
