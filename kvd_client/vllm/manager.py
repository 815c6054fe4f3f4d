"""The scheduler side: vLLM's OffloadingManager backed by the kvd daemon.

vLLM calls the manager synchronously on its scheduler thread, once per chunk per waiting request
per step. This manager never makes a blocking call there; it makes **at most one round trip
per step, in on_schedule_end, and none on a step with nothing to send**:

- lookup answers from a local view. A key not known yet answers RETRY and is collected; the
  step's round trip resolves every collected key with a lease on the hits (leased hits come back
  with their slot offsets), so the next step answers HIT, and a HIT stays loadable: the daemon
  cannot evict a leased block, and prepare_load turns the lease into a pin. Full-attention
  groups are resolved as prefixes (the daemon stops at the first key that is not a HIT, as
  vLLM's scan does), and the leases a request took but did not load are released when it loads
  or finishes, so leases never hold blocks vLLM's own manager would have been free to evict.
- prepare_load returns a spec at once from the leased offsets and queues the pin.
- prepare_store offers every new key at once with an empty spec, and on_schedule_end fills the
  spec's offsets from the daemon's answer before vLLM serialises it to the workers (it does so
  only after build_connector_meta, which ends with on_schedule_end); keys the daemon declines
  are marked SKIP and the workers leave them alone.
- completions, touches and request ends are queued and ride with the next round trip.
While the daemon is unreachable the manager answers MISS and stores nothing (degraded, never
wrong); it reconnects by itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

from kvd_client.client import KvdClient
from kvd_client.dataplane.planner import SKIP
from kvd_proto import kvd_pb2
from kvd_proto.wire import MAX_KEYS_PER_CALL

from .transfer_spec import KvdSlotsSpec

log = logging.getLogger(__name__)

MAX_KEYS_PER_OP = MAX_KEYS_PER_CALL
MAX_LOOKUP_KEYS_PER_STEP = 8192
LEASE_MARGIN_S = 2.0            # a local HIT expires this long (at most half the lease) before
                                # its lease
MISS_TTL_STEPS = 2              # a resolved MISS answers for this many steps


@dataclass(slots=True)
class _Answer:
    hit: bool
    offset: int
    pool_id: str
    epoch: int
    expires: float              # HIT: local lease deadline
    step: int                   # MISS: the step it was resolved in


@dataclass(slots=True)
class _StoreBatch:
    req_id: str
    keys: list[bytes]
    positions: list[int]
    spec: KvdSlotsSpec


class KvdOffloadingManager(OffloadingManager):
    def __init__(self, client: KvdClient, *, enable_events: bool = False,
                 lease_ms: int | None = None,
                 sliding_window_groups: Collection[int] = ()) -> None:
        self.client = client
        # Groups vLLM scans from the end for windows of hits: resolved key by key, not as a
        # prefix. Every other group is full attention: a maximal-prefix scan.
        self._suffix_groups = frozenset(sliding_window_groups)
        self.enable_events = enable_events
        # The lease asked for lookup hits (a hit needs one: it carries the offset); None: the
        # daemon's manager.default_lease, as RegisterSession tells it.
        self._lease_ms = None if lease_ms is None else max(int(lease_ms), 100)
        self._generation = client.generation
        self._step = 0
        self._answers: dict[bytes, _Answer] = {}
        self._leased: dict[str, list[bytes]] = {}             # req_id -> keys it was leased
        self._pending: dict[str, dict[bytes, None]] = {}      # req_id -> keys (ordered set)
        self._pending_count = 0
        self._stores: list[_StoreBatch] = []
        self._loads: list[kvd_pb2.PrepareLoadRequest] = []
        self._store_epochs: dict[bytes, int] = {}             # stores in flight
        self._pins: dict[bytes, list[int]] = {}               # loads in flight: key -> epochs
        self._reset_requested = False
        self._stale_stores: dict[int, list[bytes]] = {}
        self._stale_pins: dict[int, list[bytes]] = {}
        self._events: list[OffloadingEvent] = []
        self.round_trips_by_step: list[int] = []              # for tests and benchmarks

    @property
    def lease_ms(self) -> int:
        return self._lease_ms or max(self.client.default_lease_ms, 100)

    # ----------------------------------------------------------- local view
    def _sync(self) -> None:
        """A new daemon (or session) invalidates everything we know about the old one."""
        if self.client.generation != self._generation:
            self._generation = self.client.generation
            self._answers.clear()
            self._leased.clear()
            self._pending.clear()
            self._pending_count = 0
            self._store_epochs.clear()
            self._pins.clear()
            self._stale_stores.clear()
            self._stale_pins.clear()
            self._reset_requested = False

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._sync()
        if not self.client.available:
            return LookupResult.MISS
        answer = self._answers.get(key)
        if answer is not None:
            if answer.hit:
                if answer.expires > time.monotonic():
                    return LookupResult.HIT
            elif answer.step >= self._step - MISS_TTL_STEPS:
                return LookupResult.MISS
            del self._answers[key]
        if self._pending_count < MAX_LOOKUP_KEYS_PER_STEP:
            keys = self._pending.setdefault(req_context.req_id, {})
            if key not in keys:
                keys[key] = None
                self._pending_count += 1
        return LookupResult.RETRY

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext
                     ) -> LoadStoreSpec:
        keys = list(keys)
        offsets: list[int] = []
        pool_id = self.client.pool_id or ""
        epoch = self.client.epoch or 0
        for key in keys:
            answer = self._answers.pop(key, None)
            if answer is None or not answer.hit:
                # vLLM only loads keys we answered HIT in this lock region; keep going safely.
                log.error("prepare_load of a key kvd did not answer HIT; it is skipped")
                offsets.append(SKIP)
                continue
            offsets.append(answer.offset)
            pool_id, epoch = answer.pool_id, answer.epoch
            self._pins.setdefault(key, []).append(epoch)
        self._loads.append(kvd_pb2.PrepareLoadRequest(
            keys=[k for k, o in zip(keys, offsets, strict=True) if o != SKIP],
            req_id=req_context.req_id, positions=self._positions(keys, req_context)
            if SKIP not in offsets else []))
        self._release_unloaded(req_context.req_id)
        return KvdSlotsSpec(offsets, pool_id)

    def _release_unloaded(self, req_id: str) -> None:
        """Give back the leases `req_id`'s lookups took on keys it did not load (the hits past
        what vLLM loads, e.g. the last block it recomputes): vLLM's own manager holds nothing
        for them, so neither may kvd. Their answers go too; a later lookup asks again."""
        leased = self._leased.pop(req_id, None)
        if not leased:
            return
        by_epoch: dict[int, list[bytes]] = {}
        for key in leased:
            answer = self._answers.get(key)
            if answer is None or not answer.hit:
                continue          # loaded (answer consumed), or already released
            del self._answers[key]
            by_epoch.setdefault(answer.epoch, []).append(key)
        for epoch, keys in by_epoch.items():
            for i in range(0, len(keys), MAX_KEYS_PER_OP):
                # CompleteLoad of a key this session leased but did not pin ends the lease.
                self.client.queue(kvd_pb2.StepOp(complete_load=kvd_pb2.CompleteLoadRequest(
                    keys=keys[i:i + MAX_KEYS_PER_OP], epoch=epoch)))

    @staticmethod
    def _positions(keys: Sequence[bytes], ctx: ReqContext) -> list[int]:
        positions = [ctx.get_offload_key_position(k) for k in keys]
        return [] if any(p is None for p in positions) else positions  # type: ignore[misc]

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if self.client.available and keys:
            self.client.queue(kvd_pb2.StepOp(touch=kvd_pb2.TouchRequest(
                keys=list(keys), req_id=req_context.req_id)))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._sync()
        by_epoch: dict[int, list[bytes]] = {}
        for key in keys:
            epochs = self._pins.get(key)
            if not epochs:
                continue
            epoch = epochs.pop(0)
            if not epochs:
                del self._pins[key]
            by_epoch.setdefault(epoch, []).append(key)
        for epoch, group in by_epoch.items():
            self.client.queue(kvd_pb2.StepOp(complete_load=kvd_pb2.CompleteLoadRequest(
                keys=group, req_id=req_context.req_id, epoch=epoch)))

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext
                      ) -> PrepareStoreOutput | None:
        self._sync()
        keys = list(keys)
        if not self.client.available or not keys:
            return PrepareStoreOutput(keys_to_store=[], store_spec=KvdSlotsSpec([], ""),
                                      evicted_keys=[])
        spec = KvdSlotsSpec([SKIP] * len(keys), self.client.pool_id or "")
        self._stores.append(_StoreBatch(req_context.req_id, keys,
                                        self._positions(keys, req_context), spec))
        return PrepareStoreOutput(keys_to_store=keys, store_spec=spec, evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        self._sync()
        by_epoch: dict[int, list[bytes]] = {}
        for key in keys:
            epoch = self._store_epochs.pop(key, None)
            if epoch is not None:
                by_epoch.setdefault(epoch, []).append(key)
        for epoch, group in by_epoch.items():
            self.client.queue(kvd_pb2.StepOp(complete_store=kvd_pb2.CompleteStoreRequest(
                keys=group, success=success, req_id=req_context.req_id, epoch=epoch)))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        dropped = self._pending.pop(req_context.req_id, None)
        if dropped:
            self._pending_count -= len(dropped)
        self._release_unloaded(req_context.req_id)
        if self.client.available:
            self.client.queue(kvd_pb2.StepOp(request_finished=kvd_pb2.RequestFinishedRequest(
                req_id=req_context.req_id)))

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        yield from events

    def has_pending_work(self) -> bool:
        return bool(self._pending) or self.client.has_queued() or self._reset_requested

    def reset_cache(self) -> None:
        self._sync()
        self._answers.clear()
        self._pending.clear()
        self._pending_count = 0
        # The scheduler never completes jobs from before a reset; remember them so their
        # daemon-side slots (zombies) are released once the workers have flushed them.
        for key, epoch in self._store_epochs.items():
            self._stale_stores.setdefault(epoch, []).append(key)
        for key, epochs in self._pins.items():
            for epoch in epochs:
                self._stale_pins.setdefault(epoch, []).append(key)
        self._store_epochs.clear()
        self._pins.clear()
        self._leased.clear()           # the reset ends every lease at the daemon
        self._reset_requested = self.client.available

    def on_reset_flushed(self) -> None:
        self._sync()
        for epoch, keys in self._stale_stores.items():
            for i in range(0, len(keys), MAX_KEYS_PER_OP):
                self.client.queue(kvd_pb2.StepOp(complete_store=kvd_pb2.CompleteStoreRequest(
                    keys=keys[i:i + MAX_KEYS_PER_OP], success=False, epoch=epoch)))
        for epoch, keys in self._stale_pins.items():
            for key in keys:
                self.client.queue(kvd_pb2.StepOp(complete_load=kvd_pb2.CompleteLoadRequest(
                    keys=[key], epoch=epoch)))
        self._stale_stores.clear()
        self._stale_pins.clear()

    def shutdown(self) -> None:
        self.client.close()

    # ------------------------------------------------------- the round trip
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._sync()
        self._step += 1
        trips_before = self.client.round_trips
        try:
            self._round_trip()
        except Exception:  # never let kvd break a scheduler step
            log.exception("kvd round trip failed; offload skipped this step")
            self._stores.clear()
            self._loads.clear()
        self.round_trips_by_step.append(self.client.round_trips - trips_before)
        if len(self.round_trips_by_step) > 100_000:
            del self.round_trips_by_step[:50_000]

    def _round_trip(self) -> None:
        ops: list[kvd_pb2.StepOp] = []
        if self._reset_requested:
            ops.append(kvd_pb2.StepOp(reset=kvd_pb2.ResetRequest()))
        stores, self._stores = self._stores, []
        for batch in stores:
            ops.append(kvd_pb2.StepOp(prepare_store=kvd_pb2.PrepareStoreRequest(
                keys=batch.keys, req_id=batch.req_id, positions=batch.positions)))
        lookups: list[tuple[str, list[bytes]]] = []
        for req_id, keys in self._pending.items():
            by_group: dict[bytes, list[bytes]] = {}
            for key in keys:                         # in the order vLLM scanned them
                by_group.setdefault(key[-4:], []).append(key)
            for group, key_list in by_group.items():
                prefix = int.from_bytes(group, "big") not in self._suffix_groups
                for i in range(0, len(key_list), MAX_KEYS_PER_OP):
                    part = key_list[i:i + MAX_KEYS_PER_OP]
                    lookups.append((req_id, part))
                    ops.append(kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(
                        keys=part, lease_ms=self.lease_ms, req_id=req_id, prefix=prefix)))
        self._pending.clear()
        self._pending_count = 0
        loads, self._loads = self._loads, []
        # Pins go last: if one fails (its lease ran out), the ops before it still took effect.
        ops.extend(kvd_pb2.StepOp(prepare_load=op) for op in loads if op.keys)
        if self.enable_events and self.client.available:
            ops.append(kvd_pb2.StepOp(take_events=kvd_pb2.TakeEventsRequest()))
        if not ops:
            self.client.flush()        # completions only if any are queued; else no RPC
            return
        sent_at = time.monotonic()
        results = self.client.step(ops)
        if results is None:
            self._reset_requested = self._reset_requested and self.client.available
            for load in loads:         # never pinned: forget them
                for key in load.keys:
                    epochs = self._pins.get(key)
                    if epochs:
                        epochs.pop()
                        if not epochs:
                            del self._pins[key]
            return
        self._reset_requested = False
        pool_id = self.client.pool_id or ""
        it = iter(results)
        if ops and ops[0].HasField("reset"):
            next(it)
        for batch in stores:
            answer = next(it).prepare_store
            batch.spec.pool_id = pool_id
            if answer.cannot_store:
                continue
            granted = dict(zip(answer.keys_to_store, answer.slot_offsets, strict=True))
            for i, key in enumerate(batch.keys):
                offset = granted.get(key)
                if offset is not None:
                    batch.spec.offsets[i] = offset
                    self._store_epochs[key] = answer.epoch
        for req_id, part in lookups:
            answer = next(it).lookup
            # The lease the daemon granted (it caps what was asked at its max_lease).
            lease_s = (answer.lease_ms or self.lease_ms) / 1000.0
            expires = sent_at + lease_s - min(LEASE_MARGIN_S, lease_s / 2)
            # A prefix lookup answers up to the first key that is not a HIT; the keys after it
            # stay unknown (vLLM's scan stops at a MISS; after a HIT_PENDING it asks again).
            offsets = answer.slot_offsets
            for i, (key, state) in enumerate(zip(part, answer.states, strict=False)):
                if state == kvd_pb2.BLOCK_STATE_HIT:
                    offset = offsets[i] if i < len(offsets) else SKIP
                    self._answers[key] = _Answer(True, offset, pool_id,
                                                 answer.epoch, expires, self._step)
                    self._leased.setdefault(req_id, []).append(key)
                elif state == kvd_pb2.BLOCK_STATE_MISS:
                    self._answers[key] = _Answer(False, 0, pool_id, answer.epoch, 0.0,
                                                 self._step)
                # HIT_PENDING: not recorded, asked again next step
        for _ in (op for op in loads if op.keys):
            next(it)
        if self.enable_events and self.client.available:
            for event in next(it).take_events.events:
                self._events.append(OffloadingEvent(keys=list(event.keys), medium=Medium.CPU,
                                                    removed=event.removed,
                                                    metadata_only=event.metadata_only))
        self._trim_answers()

    def _trim_answers(self) -> None:
        """Bound the local view: drop expired hits and old misses."""
        if len(self._answers) < 65_536:
            return
        now = time.monotonic()
        floor = self._step - MISS_TTL_STEPS
        self._answers = {k: a for k, a in self._answers.items()
                         if (a.expires > now if a.hit else a.step >= floor)}
