"""The call protocol: how an engine that does not map its namespace's index loads and stores.

Such an engine asks the daemon for everything over gRPC (the unary RPCs or their StepStream
ops): `Lookup` answers its states and, when asked, leases each hit so it stays readable until
`PrepareLoad` pins it; `PrepareStore` has the daemon pick (and evict for) the slots it will
write. The shared-index protocol (kvd_server/protocols/fastpath.py) replaces exactly these three: its
engines look up in the index themselves, pin what they found (Pin) and store into slots
granted in advance (StoreGranted). Both end the same way: `CompleteLoad`, `CompleteStore` and
`Touch` settle pins and pending stores on the core (KvdCore), which owns them for both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from kvd_proto.wire import MAX_KEYS_PER_CALL
from kvd_server.core.sessions import MAX_PENDING_STORES_PER_SESSION
from kvd_server.errors import Unavailable
from kvd_server.manager import Lookup

if TYPE_CHECKING:
    from kvd_server.core.core import KvdCore
    from kvd_server.core.namespaces import Namespace
    from kvd_server.core.sessions import Session
    from kvd_server.manager.namespace import NamespaceManager


class Below(Protocol):
    """The tier below the pool, as both protocols see it (kvd_server/tiers/link.py's
    `TierLink`): promotion of keys only it holds."""

    def promote(self, ns: Namespace, keys: Sequence[bytes], prefix: bool = False
                ) -> set[bytes]: ...

    def find(self, ns: Namespace, keys: Sequence[bytes], done: Callable[[], None]
             ) -> bool: ...


class LookupAnswer(NamedTuple):
    states: list[Lookup]
    epoch: int
    offsets: list[int] | None     # slot offsets (0 where not a HIT) when a lease was asked
    lease_s: float                # the lease granted to the HITs (0: none asked)


class LoadAnswer(NamedTuple):
    offsets: list[int]
    epoch: int


@dataclass(slots=True, frozen=True)
class StoreDecision:
    cannot_store: bool
    keys_to_store: list[bytes]
    slot_offsets: list[int]
    evicted_keys: list[bytes]


class StoreAnswer(NamedTuple):
    decision: StoreDecision
    epoch: int


def _nothing() -> None:
    """A find whose answer nobody waits for (the call protocol answers MISS at once)."""


def _missing(mgr: NamespaceManager, keys: Sequence[bytes]) -> list[bytes]:
    """Of `keys`, at most MAX_KEYS_PER_CALL the pool does not hold (the ones worth asking)."""
    lookup = mgr.lookup
    return [k for k in keys[:MAX_KEYS_PER_CALL] if lookup(k) is Lookup.MISS]


class CallPath:
    """The call protocol's operations (see the module doc); runs on the event loop."""

    def __init__(self, core: KvdCore, below: Below | None = None) -> None:
        self.core = core
        self.below = below

    def lookup(self, s: Session, keys: Sequence[bytes], *, prefix: bool = False,
               lease_ms: int = 0, req_id: str = "") -> LookupAnswer:
        """States of `keys` (prefix: up to the first key that is not a HIT); with `lease_ms`,
        each HIT is leased (capped at manager.max_lease) and its slot offset returned."""
        core, below = self.core, self.below
        ns = core.namespace_of(s)
        mgr = ns.mgr
        epoch = mgr.epoch
        lease_s = min(lease_ms / 1000.0, core.config.manager.max_lease) if lease_ms else 0.0
        expiry = core.clock() + lease_s
        states: list[Lookup] = []
        offsets: list[int] | None = [] if lease_s > 0 else None
        hits = misses = 0
        asked = False
        for i, key in enumerate(keys):
            state = mgr.lookup(key)
            if state is Lookup.MISS and below is not None:
                if below.promote(ns, [key]):
                    state = Lookup.HIT_PENDING   # held below only: HIT_PENDING until promoted
                    if prefix:                   # the answer stops here; the prefix comes up
                        below.promote(ns, keys[i + 1:], prefix=True)
                elif not asked:
                    # Held nowhere on this node: the cluster store (if any) is asked about
                    # the rest of the keys in the background; what it holds is held below
                    # at the engine's next lookup (this one answers MISS: no wait).
                    asked = below.find(ns, _missing(mgr, keys[i:]), _nothing)
            states.append(state)
            offset = 0
            if state is Lookup.HIT:
                hits += 1
                if offsets is not None:
                    slot = core.leases.grant(s, mgr, key, expiry, epoch)
                    if slot is not None:
                        offset = ns.slots.offset(slot)
            elif state is Lookup.MISS:
                misses += 1
            if offsets is not None:
                offsets.append(offset)
            if prefix and state is not Lookup.HIT:
                break
        ns.lookups_total += len(states)
        ns.hits_total += hits
        ns.misses_total += misses
        return LookupAnswer(states, epoch, offsets, lease_s)

    def prepare_load(self, s: Session, keys: Sequence[bytes], req_id: str,
                     positions: Sequence[int] | None) -> LoadAnswer:
        """Pin ready (or leased) blocks for a load; all or nothing (NotReady names the first
        key that is not readable)."""
        core = self.core
        ns = core.namespace_of(s)
        core.check_pin_room(s, len(keys))
        mgr = ns.mgr
        epoch = mgr.epoch
        slots = mgr.prepare_load(keys, core.request_key(s, req_id), positions or None)
        pins = s.pins
        take_back = core.leases.take_back if s.leases else None
        for key in keys:
            if take_back is not None:
                take_back(s, mgr, key, epoch)        # the pin just taken replaces a lease
            pins[(epoch, key)] = pins.get((epoch, key), 0) + 1
        if s.hints:
            core.retention.touched(s, req_id, keys)
        if mgr.retention.prewarmed:
            mgr.retention.loaded(keys)
        offset = ns.slots.offset
        return LoadAnswer([offset(slot) for slot in slots], epoch)

    def prepare_store(self, s: Session, keys: Sequence[bytes], req_id: str,
                      positions: Sequence[int] | None) -> StoreAnswer:
        """Reserve slots for the keys worth storing, evicting for them as vLLM's
        prepare_store does; cannot_store (not an error) when none can be had now."""
        core = self.core
        ns = core.namespace_of(s)
        if core.draining:
            raise Unavailable("daemon is draining; stores are refused")
        mgr = ns.mgr
        epoch = mgr.epoch
        if len(s.pending) + len(keys) > MAX_PENDING_STORES_PER_SESSION:
            # Not an error, like a full pool: complete the stores in flight and offer again.
            return StoreAnswer(StoreDecision(True, [], [], []), epoch)
        grant = mgr.prepare_store(keys, core.request_key(s, req_id), positions or None,
                                  ns.reserve_owed)
        if grant is None:
            return StoreAnswer(StoreDecision(True, [], [], []), epoch)
        offset = ns.slots.offset
        pending = s.pending
        for key, slot in zip(grant.keys_to_store, grant.slots, strict=True):
            pending[(epoch, key)] = slot
        return StoreAnswer(StoreDecision(False, grant.keys_to_store,
                                         [offset(x) for x in grant.slots], grant.evicted_keys),
                           epoch)
