"""The offload protocol of one engine, engine-neutral: nothing here ever waits for the daemon.

An engine's scheduler asks, every step, which blocks are cached, pins the ones it loads,
reserves slots for the ones it stores and reports what finished. `OffloadSession` answers all
of that from local state:

- lookups read the namespace's shared index (kvd_client/index_reader.py) directly;
- a HIT stays loadable without a pin round trip: the session publishes, before each step's
  lookups, the oldest reclaim epoch it may still act on (its loads in flight), and the daemon
  reuses a freed slot only after every reader has moved past it;
- stores go to slots the daemon granted in advance (a reserve refilled in the background);
  with too small a reserve, `reserve` declines at once (the engine offers again later);
- everything the daemon must hear (pins for its eviction order, stores, completions, request
  ends, grant requests, event pulls) is queued per step and sent by a background thread on the
  session's StepStream; answers are applied at the next step.

A dead or slow daemon costs a step nothing: lookups answer MISS and stores are declined until
the client is back. The vLLM plug-in (kvd_client/vllm/manager.py) only translates vLLM's calls
to these; another engine can drive it the same way (docs/client.md).
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvd_proto import kvd_pb2
from kvd_proto.wire import MAX_KEYS_PER_CALL, MAX_OPS_PER_STEP

from .client import KvdClient
from .index_reader import STATE_READY, IndexReader, Marks

log = logging.getLogger(__name__)

DEFAULT_RESERVE = 256           # slots granted in advance (what one step may store at once)
MAX_BATCHES_IN_FLIGHT = 64      # steps handed to the sender and not answered; past it, later
                                # steps' messages wait in the session and ride together
MAX_CARRIED_OPS = 1 << 16       # messages waiting so; past it the session restarts (the daemon
                                # cannot keep up: its stores and pins are released for us)
MAX_COALESCED = 64              # step batches the sender puts into one request
MAX_LOCAL_STORES = 1 << 16
MAX_PIN_BATCHES = 1024         # pins remembered whole, for unpin's fast path (~ loads in flight)
UNKNOWN_EPOCH = -1              # a store made while a reset is on its way to the daemon


class Lookup(enum.Enum):
    MISS = "miss"
    HIT = "hit"
    PENDING = "pending"         # being stored: not readable yet


@dataclass(slots=True, frozen=True)
class Event:
    """A stored (removed=False) or removed event of the namespace's blocks."""

    keys: tuple[bytes, ...]
    removed: bool
    metadata_only: bool = False


_Load = tuple[int, int, str]                 # a load in flight: (reclaim, reset, req_id)
_Held = _Load | list[_Load]


def _held(value: _Held) -> list[_Load]:
    """A key's loads in flight, as a list."""
    return [value] if type(value) is tuple else value


@dataclass(slots=True)
class _Store:
    offset: int
    reset_epoch: int
    batch: int                  # the step batch that told the daemon about it
    completed: bool = False


# A queued message, as the scheduler thread leaves it: (kind, *fields). The sender thread
# turns them into StepOps (`_wire`), so the step pays for no protobuf work.
_Op = tuple


@dataclass(slots=True)
class _Batch:
    seq: int
    generation: int
    ops: list[_Op] = field(default_factory=list)
    essential: bool = True      # carries more than grant requests: the engine waits for it


def _chunks(keys: Sequence, size: int = MAX_KEYS_PER_CALL) -> range:
    return range(0, max(1, len(keys)), size)


def _wire(op: _Op) -> list[kvd_pb2.StepOp]:
    """One queued message as the StepOps that carry it (split to the per-call key bound)."""
    kind = op[0]
    if kind == "pin":
        _, keys, req_id, pos, offsets = op
        return [kvd_pb2.StepOp(pin=kvd_pb2.PinRequest(
            keys=keys[i:i + MAX_KEYS_PER_CALL], req_id=req_id,
            positions=pos[i:i + MAX_KEYS_PER_CALL],
            slot_offsets=offsets[i:i + MAX_KEYS_PER_CALL])) for i in _chunks(keys)]
    if kind == "store_granted":
        _, keys, req_id, pos, granted = op
        ops = []
        for i in _chunks(keys):
            part = set(keys[i:i + MAX_KEYS_PER_CALL])
            mine = [(k, o) for k, o in granted if k in part]
            ops.append(kvd_pb2.StepOp(store_granted=kvd_pb2.StoreGrantedRequest(
                keys=keys[i:i + MAX_KEYS_PER_CALL], req_id=req_id,
                positions=pos[i:i + MAX_KEYS_PER_CALL],
                granted_keys=[k for k, _ in mine], granted_offsets=[o for _, o in mine])))
        return ops
    if kind == "complete_load":
        _, keys, req_id, epoch = op
        return [kvd_pb2.StepOp(complete_load=kvd_pb2.CompleteLoadRequest(
            keys=keys[i:i + MAX_KEYS_PER_CALL], req_id=req_id, epoch=epoch))
            for i in _chunks(keys)]
    if kind == "complete_store":
        _, keys, success, req_id, epoch = op
        return [kvd_pb2.StepOp(complete_store=kvd_pb2.CompleteStoreRequest(
            keys=keys[i:i + MAX_KEYS_PER_CALL], success=success, req_id=req_id, epoch=epoch))
            for i in _chunks(keys)]
    if kind == "touch":
        _, keys, req_id = op
        return [kvd_pb2.StepOp(touch=kvd_pb2.TouchRequest(
            keys=keys[i:i + MAX_KEYS_PER_CALL], req_id=req_id)) for i in _chunks(keys)]
    if kind == "request_finished":
        return [kvd_pb2.StepOp(request_finished=kvd_pb2.RequestFinishedRequest(req_id=op[1]))]
    if kind == "grant":
        return [kvd_pb2.StepOp(grant=kvd_pb2.GrantRequest(count=op[1]))]
    if kind == "reset":
        return [kvd_pb2.StepOp(reset=kvd_pb2.ResetRequest())]
    if kind == "take_events":
        return [kvd_pb2.StepOp(take_events=kvd_pb2.TakeEventsRequest())]
    raise ValueError(f"unknown offload message {kind!r}")


class OffloadSession:
    """One engine's offload session over a `KvdClient` (see the module doc)."""

    def __init__(self, client: KvdClient, *, reserve: int = DEFAULT_RESERVE,
                 enable_events: bool = False,
                 answers: tuple[Any, Any, Any] = (Lookup.MISS, Lookup.HIT, Lookup.PENDING)
                 ) -> None:
        """`answers`: what `lookup` returns for a miss, a hit and a pending store; an engine
        may pass its own values, so that its scheduler can call `lookup` directly (it is the
        hottest call: once per chunk of every waiting request, every step)."""
        self.client = client
        self._miss, self._hit, self._pending = answers
        self.reserve_target = max(1, reserve)
        self.enable_events = enable_events
        self._generation = -1
        self._index: IndexReader | None = None
        self._marks: Marks | None = None
        self._reset_epoch = 0
        self._pool_id = ""
        # step state (scheduler thread)
        self._in_step = False
        self._step_epoch = 0
        self._hits: dict[bytes, int] = {}                       # this step's HITs -> offset
        self._ops: list[_Op] = []
        self._seq = 0
        # copies in flight
        # key -> its load in flight (reclaim epoch, reset epoch, request), or a list of them
        # while several requests load it: one tuple shared by the keys of one pin keeps pin
        # and unpin free of per-key Python in the common case.
        self._loads: dict[bytes, _Held] = {}
        # (request, keys) of each pin in flight -> its epochs tuple: an engine that finishes
        # a load with the keys it started (vLLM does, in another order) releases them without
        # a per-key search,
        # even where other requests load the same keys (shared prefixes). A cache: `_loads`
        # stays the truth, and an entry dropped at the bound only costs the slower path.
        self._pin_batches: dict[tuple[str, frozenset[bytes]], _Load] = {}
        self._load_epochs: collections.Counter[int] = collections.Counter()
        # epochs of loads that were in flight at a reset: they still copy (vLLM finishes
        # them) and stay protected until reset_flushed
        self._stale_epochs: collections.Counter[int] = collections.Counter()
        self._stores: dict[bytes, _Store] = {}
        self._reserve: collections.deque[int] = collections.deque()
        self._granting = 0                                       # slots asked, not answered
        self._events: list[Event] = []
        self._reset_pending = False
        self._stale_stores: dict[int, list[bytes]] = {}
        self._stale_loads: dict[int, list[bytes]] = {}
        self._deferred: list[tuple[bytes, str, bool]] = []   # completions awaiting an epoch
        self._old_sessions: list[str] = []        # ended sessions whose copies still run
        self._old_copies = 0
        # the sender thread and what it hands back
        self._lock = threading.Lock()             # publishing marks vs the step boundary
        self._outbox: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        # (batch, answers): the sender's digest of the results the session applies, in order,
        # or None when the daemon did not take the batch
        self._inbox: queue.SimpleQueue[tuple[_Batch, list[tuple] | None]] = queue.SimpleQueue()
        self._in_flight = 0
        self._in_flight_essential = 0
        self._acked = -1
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, name="kvd-offload-sender",
                                        daemon=True)
        self._sender.start()
        # What a (re)connection set up for the next step to adopt: made in whichever thread
        # connects (the constructor's, or the client's background thread), never in a step.
        self._handoff: tuple[int, IndexReader, Marks, list[int]] | None = None
        client.on_reconnect = self._on_connect
        if client.available:
            self._on_connect()

    def _on_connect(self) -> None:
        """A new session with the daemon: map its index and take the first grant now, so the
        first step already answers lookups and stores."""
        generation = self.client.generation
        mapped = self.client.map_index()
        if mapped is None:
            return
        # Its marks stay 0 ("nothing read") until the first step publishes an epoch.
        try:
            index = IndexReader(mapped[0])
        except (OSError, ValueError) as exc:
            for fd in mapped:
                os.close(fd)
            log.error("kvd daemon handed over an index this client cannot read (%s); "
                      "offload stays off for this session", exc)
            return
        marks = Marks(mapped[1])
        offsets: list[int] = []
        results = self.client.step([kvd_pb2.StepOp(grant=kvd_pb2.GrantRequest(
            count=self.reserve_target))])
        if results:
            offsets = list(results[0].grant.slot_offsets)
        with self._lock:
            stale, self._handoff = self._handoff, (generation, index, marks, offsets)
        if stale is not None:
            stale[1].close()
            stale[2].close()

    # ------------------------------------------------------------------ state
    @property
    def available(self) -> bool:
        return self.client.available and self._index is not None

    @property
    def pool_id(self) -> str:
        return self._pool_id

    def _sync(self) -> None:
        """A new session (reconnect) replaces everything learned from the old one."""
        generation = self.client.generation
        if generation == self._generation:
            return
        old_session = self.client.previous_session_id
        copies = sum(len(_held(v)) for v in self._loads.values()) + len(self._stores)
        if old_session and copies:
            self._old_sessions.append(old_session)
            self._old_copies += copies
        with self._lock:
            self._generation = generation
            self._close_index()
        self._hits.clear()
        self._loads.clear()
        self._pin_batches.clear()
        self._load_epochs.clear()
        self._stale_epochs.clear()
        self._stores.clear()
        self._reserve.clear()
        self._granting = 0
        self._reset_pending = False
        self._stale_stores.clear()
        self._stale_loads.clear()
        self._deferred.clear()
        self._adopt()

    def _adopt(self) -> None:
        """Take over what the connection set up for the current client generation."""
        with self._lock:
            handoff = self._handoff
            if handoff is None or handoff[0] != self._generation or self._index is not None:
                return
            self._handoff = None
            _, self._index, self._marks, offsets = handoff
        self._reserve.extend(offsets)
        self._pool_id = self.client.pool_id or ""

    def _close_index(self) -> None:
        if self._index is not None:
            self._index.close()
            self._index = None
        if self._marks is not None:
            self._marks.close()
            self._marks = None

    def _begin(self) -> None:
        """The first call of a step: apply the daemon's answers, then publish the epoch this
        step's lookups may act on (before any of them reads the index)."""
        if self._in_step:
            return
        self._apply_answers()
        self._sync()
        if self._index is None:
            self._adopt()
        with self._lock:
            self._in_step = True
            if self._index is not None and self._marks is not None:
                self._step_epoch = self._index.reclaim_epoch
                if not self._reset_pending:
                    self._reset_epoch = self._index.reset_epoch
                held = list(self._load_epochs) + list(self._stale_epochs)
                self._marks.publish(min([self._step_epoch, *held]))

    # --------------------------------------------------------------- lookups
    def lookup(self, key: bytes, _context: object = None) -> Any:
        """Whether `key` is cached: HIT (loadable now), PENDING (being stored) or MISS (as
        the `answers` given at construction). `_context` is ignored (an engine's per-request
        argument, so the engine can call this method directly)."""
        if not self._in_step:
            self._begin()
        index = self._index
        if index is None or self._reset_pending or not self.client.available:
            return self._miss
        memo = index.memo.get(key)        # a repeated lookup: one read (IndexReader.find)
        if memo is not None and index.meta[memo[0]] == memo[1] and memo[1] & 3 == STATE_READY:
            self._hits[key] = memo[2]
            return self._hit
        found = index.find(key)
        if found is not None:
            state, offset = found
            if state == STATE_READY:
                self._hits[key] = offset
                return self._hit
            store = self._stores.get(key)
            if store is not None and store.completed and store.offset == offset:
                self._hits[key] = offset              # ours, completed: the daemon catches up
                index.expect_ready(key, offset)       # so the next lookup is one read
                return self._hit
            return self._pending
        store = self._stores.get(key)
        if store is not None and store.batch > self._acked:
            # The daemon has not heard of this store yet: the slot is still ours alone.
            if store.completed:
                self._hits[key] = store.offset
                return self._hit
            return self._pending
        return self._miss

    def hit_offset(self, key: bytes) -> int | None:
        """The pool offset a HIT of this step found (None: `key` was no HIT this step)."""
        return self._hits.get(key)

    # ------------------------------------------------------------------ loads
    def pin(self, keys: Sequence[bytes], req_id: str = "",
            positions: Sequence[int] | None = None) -> list[int | None]:
        """Start loads of keys this step's lookups found HIT: their offsets (None for a key
        that was not). The slots stay readable until `unpin`."""
        if not self._in_step:
            self._begin()
        offsets: list[int | None] = list(map(self._hits.get, keys))
        if None in offsets:
            loaded = [k for k, o in zip(keys, offsets, strict=True) if o is not None]
            loaded_offsets = [o for o in offsets if o is not None]
        else:
            loaded, loaded_offsets = list(keys), offsets
        if not loaded:
            return offsets
        epochs = (self._step_epoch, self._reset_epoch, req_id)
        loads = self._loads
        fresh = dict.fromkeys(loaded, epochs)
        if len(fresh) == len(loaded) and loads.keys().isdisjoint(fresh):
            loads.update(fresh)                 # the common case: no key loading already
        else:
            for key in loaded:
                held = loads.get(key)
                if held is None:
                    loads[key] = epochs
                elif type(held) is tuple:
                    loads[key] = [held, epochs]
                else:
                    held.append(epochs)
        self._load_epochs[self._step_epoch] += len(loaded)
        batches = self._pin_batches
        if len(batches) >= MAX_PIN_BATCHES:
            del batches[next(iter(batches))]
        batches[(req_id, frozenset(loaded))] = epochs
        pos = list(positions) if positions and len(positions) == len(keys) else []
        if pos and len(loaded) != len(keys):
            pos = [p for p, o in zip(pos, offsets, strict=True) if o is not None]
        self._ops.append(("pin", loaded, req_id, pos, loaded_offsets))
        return offsets

    def unpin(self, keys: Sequence[bytes], req_id: str = "") -> None:
        """Loads of `keys` finished (every worker copied)."""
        loads = self._loads
        held = list(map(loads.get, keys))
        first = held[0] if held else None
        released: dict[int, int]
        by_reset: dict[int, list[bytes]]
        batch = self._pin_batches.pop((req_id, frozenset(keys)), None) if keys else None
        if batch is not None and self._release_batch(keys, held, batch):
            released = {batch[0]: len(held)}
            by_reset = {batch[1]: list(keys)}
        elif type(first) is tuple and first[2] == req_id and held.count(first) == len(held) \
                and len(set(keys)) == len(held):
            # The common case: one load of each key in flight, all pinned by this request.
            collections.deque(map(loads.pop, keys), maxlen=0)
            released = {first[0]: len(held)}
            by_reset = {first[1]: list(keys)}
        else:
            released, by_reset = self._unpin_each(keys, req_id)
        load_epochs = self._load_epochs
        for reclaim, n in released.items():
            load_epochs[reclaim] -= n
            if load_epochs[reclaim] <= 0:
                del load_epochs[reclaim]
        if not load_epochs:
            self._publish_idle()
        for reset, group in by_reset.items():
            self._queue(("complete_load", group, req_id, reset))

    def _release_batch(self, keys: Sequence[bytes], held: list[_Held | None],
                       epochs: _Load) -> bool:
        """End the load `epochs` of every key in `keys` (one pin, started together), shared
        with other requests' loads or not; False (nothing changed) unless each key holds it."""
        if len(set(keys)) != len(keys):
            return False
        if held.count(epochs) == len(held):           # nobody else loads these keys
            collections.deque(map(self._loads.pop, keys), maxlen=0)
            return True
        for h in held:
            if h is None or (h != epochs and (type(h) is tuple or epochs not in h)):
                return False
        loads = self._loads
        for key, h in zip(keys, held, strict=True):
            if type(h) is tuple:
                del loads[key]
            else:
                h.remove(epochs)                    # an equal tuple is the same load
                if len(h) == 1:
                    loads[key] = h[0]
        return True

    def _unpin_each(self, keys: Sequence[bytes], req_id: str
                    ) -> tuple[dict[int, int], dict[int, list[bytes]]]:
        """unpin, key by key: (loads released per reclaim epoch, keys per reset epoch).

        A key several requests load ends the load of `req_id`; failing that (an engine that
        names no requests) the newest, so the loads left hold the older epochs: a floor too
        low holds freed slots back a little longer, one too high could hand a slot still
        being read to a new store."""
        by_reset: dict[int, list[bytes]] = {}
        released: dict[int, int] = {}
        loads = self._loads
        last: _Load | None = None        # keys pinned together share one tuple: count runs
        group: list[bytes] = []
        run = 0
        for key in keys:
            held = loads.get(key)
            if held is None:
                self._finished_old_copy()
                continue
            if type(held) is tuple:
                epochs = held
                del loads[key]
            else:
                epochs = next((e for e in held if e[2] == req_id), None) or max(held)
                held.remove(epochs)
                if len(held) == 1:
                    loads[key] = held[0]
            if epochs is not last:
                if last is not None:
                    released[last[0]] = released.get(last[0], 0) + run
                last, run = epochs, 0
                group = by_reset.setdefault(epochs[1], [])
            run += 1
            group.append(key)
        if last is not None:
            released[last[0]] = released.get(last[0], 0) + run
        return released, by_reset

    # ----------------------------------------------------------------- stores
    def reserve(self, keys: Sequence[bytes], req_id: str = "",
                positions: Sequence[int] | None = None) -> list[tuple[bytes, int]] | None:
        """Slots for the offered keys that are new: [(key, offset)] (keys stored or being
        stored already are left out), or None when the reserve cannot hold them all now."""
        self._begin()
        index = self._index
        if index is None or not self.client.available:
            return []
        stores = self._stores
        # Until the daemon has done a reset this session asked for, the index still shows
        # what the reset drops: only this session's own later stores count as present.
        find = None if self._reset_pending else index.find
        new = [key for key in keys
               if key not in stores and (find is None or find(key) is None)]
        reserve = self._reserve
        if len(new) > len(reserve):
            self.reserve_target = max(self.reserve_target, 2 * len(new))
            return None
        batch = self._seq
        # During a reset this session asked for, the stores' epoch is the reset's answer:
        # UNKNOWN_EPOCH until it arrives.
        epoch = UNKNOWN_EPOCH if self._reset_pending else self._reset_epoch
        granted = [(key, reserve.popleft()) for key in new]
        room = MAX_LOCAL_STORES - len(stores)
        for key, offset in granted[:max(0, room)]:
            stores[key] = _Store(offset, epoch, batch)
        pos = list(positions) if positions and len(positions) == len(keys) else []
        self._ops.append(("store_granted", list(keys), req_id, pos, granted))
        return granted

    def complete_store(self, keys: Sequence[bytes], req_id: str = "",
                       success: bool = True) -> None:
        """Stores of `keys` finished (every worker wrote its share)."""
        by_reset: dict[int, list[bytes]] = {}
        for key in keys:
            store = self._stores.get(key)
            if store is None:
                self._finished_old_copy()
                continue
            if success:
                store.completed = True       # lookups see it (and prime the memo: lookup)
            else:
                del self._stores[key]
            if store.reset_epoch == UNKNOWN_EPOCH:
                self._deferred.append((key, req_id, success))
                continue
            by_reset.setdefault(store.reset_epoch, []).append(key)
        self._send_completions(by_reset, req_id, success)

    def _send_completions(self, by_reset: dict[int, list[bytes]], req_id: str,
                          success: bool) -> None:
        for reset, group in by_reset.items():
            self._queue(("complete_store", group, success, req_id, reset))

    # ---------------------------------------------------------- request scope
    def touch(self, keys: Sequence[bytes], req_id: str = "") -> None:
        if keys:
            self._queue(("touch", list(keys), req_id))

    def request_finished(self, req_id: str) -> None:
        self._queue(("request_finished", req_id))

    # ------------------------------------------------------------------ resets
    def reset(self) -> None:
        """Drop every block of the namespace; copies in flight finish harmlessly."""
        self._sync()
        if not self.available:
            return
        self._queue(("reset",))
        self._reset_pending = True
        for key, store in self._stores.items():
            self._stale_stores.setdefault(store.reset_epoch, []).append(key)
        for key, held in self._loads.items():
            for _, reset, _ in _held(held):
                self._stale_loads.setdefault(reset, []).append(key)
        self._stores.clear()
        self._loads.clear()
        self._pin_batches.clear()
        self._stale_epochs.update(self._load_epochs)
        self._load_epochs.clear()
        self._hits.clear()

    def reset_flushed(self) -> None:
        """Every copy that was in flight at the last reset has finished: release their slots
        at the daemon (it kept them, as zombies, until now)."""
        for reset, keys in self._stale_stores.items():
            self._queue(("complete_store", keys, False, "", reset))
        for reset, keys in self._stale_loads.items():
            for key in keys:          # one per load: a key may have several in flight
                self._queue(("complete_load", [key], "", reset))
        self._stale_stores.clear()
        self._stale_loads.clear()
        self._stale_epochs.clear()

    # ------------------------------------------------------------------ events
    def take_events(self) -> list[Event]:
        self._apply_answers()
        events, self._events = self._events, []
        return events

    # --------------------------------------------------------------- the step
    def end_step(self) -> None:
        """The step is over: this step's HITs lapse and its messages go to the sender."""
        self._sync()
        with self._lock:
            self._in_step = False
            self._hits.clear()
        self._publish_idle()
        if not self.available:
            self._ops.clear()
            return
        want = self.reserve_target - len(self._reserve) - self._granting
        if want > 0:
            self._ask_grant(want)
        if not self._ops:
            return
        if self._in_flight >= MAX_BATCHES_IN_FLIGHT:
            # The sender is behind: nothing is dropped (a lost completion would leave a
            # block storing for ever); the messages ride with a later step's batch, under the
            # same batch number the stores recorded.
            if len(self._ops) > MAX_CARRIED_OPS:
                log.error("kvd daemon is %d steps behind with %d messages waiting; "
                          "restarting the session", self._in_flight, len(self._ops))
                self._ops.clear()
                self.client.restart("the daemon does not keep up with this engine's messages")
            return
        essential = any(op[0] != "grant" for op in self._ops)
        if self.enable_events and essential:
            self._ops.append(("take_events",))
        batch = _Batch(self._seq, self._generation, self._ops, essential)
        self._ops = []
        self._seq += 1
        self._in_flight += 1
        self._in_flight_essential += essential
        self._outbox.put(batch)

    def has_pending_work(self) -> bool:
        """Messages queued or not yet answered (keep the engine stepping until they are)."""
        self._apply_answers()
        if self._in_flight_essential > 0 or self._reset_pending:
            # Only an engine with nothing to schedule asks, in a loop: hand the sender the
            # interpreter (a yield, not a wait; no request is kept waiting by it).
            time.sleep(0)
            return True
        return any(op[0] != "grant" for op in self._ops)

    def _ask_grant(self, want: int | None = None) -> None:
        want = self.reserve_target if want is None else want
        self._granting += want
        self._ops.append(("grant", want))

    def _queue(self, op: _Op) -> None:
        if self.client.available:
            self._ops.append(op)

    def _finished_old_copy(self) -> None:
        """A copy of an earlier session finished; when the last one does, the daemon may
        release what it held for that session (its process lives on: this one)."""
        if self._old_copies:
            self._old_copies -= 1
            if not self._old_copies:
                for session_id in self._old_sessions:
                    self.client.release_held(session_id)
                self._old_sessions.clear()

    # ---------------------------------------------------------- answers
    def _apply_answers(self) -> None:
        while True:
            try:
                batch, results = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._in_flight -= 1
            self._in_flight_essential -= batch.essential
            self._acked = max(self._acked, batch.seq)
            if batch.generation != self._generation:
                continue
            if results is None:           # the daemon did not take it: reconnect follows
                self._granting = 0
                if self._reset_pending:
                    self._reset_done(self._reset_epoch)
                continue
            for kind, value, extra in results:
                if kind == "grant":
                    self._granting -= value
                    self._reserve.extend(extra)
                elif kind == "reset":
                    self._reset_done(value)
                else:
                    self._events.extend(extra)
            self._granting = max(self._granting, 0)
            self._forget_settled_stores()

    def _reset_done(self, epoch: int) -> None:
        """The daemon did the reset: the stores made meanwhile belong to its new epoch."""
        self._reset_pending = False
        self._reset_epoch = epoch
        for store in self._stores.values():
            if store.reset_epoch == UNKNOWN_EPOCH:
                store.reset_epoch = epoch
        deferred, self._deferred = self._deferred, []
        for key, req_id, success in deferred:
            self._send_completions({epoch: [key]}, req_id, success)

    def _forget_settled_stores(self) -> None:
        """Completed stores the daemon has heard of are answered by the index from now on."""
        acked = self._acked
        settled = [k for k, s in self._stores.items() if s.completed and s.batch <= acked]
        for key in settled:
            del self._stores[key]

    # ---------------------------------------------------------- the sender
    def _send_loop(self) -> None:
        """Send what the steps handed over; batches waiting together go as one request, so
        the sender keeps up however fast the engine steps."""
        stop = False
        while not stop:
            batch = self._outbox.get()
            if batch is None:
                return
            batches = [batch]
            while len(batches) < MAX_COALESCED:
                try:
                    more = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batches.append(more)
            answers: list[list[tuple] | None] = [None] * len(batches)
            try:
                answers = self._send(batches)
            except Exception:  # the sender must outlive any bug: a reconnect follows
                log.exception("kvd sender failed on a step's messages")
                self.client.restart("the sender failed on a step's messages")
            for sent, answer in zip(batches, answers, strict=True):
                self._inbox.put((sent, answer))
            try:
                self._publish_idle()
            except Exception:
                log.exception("kvd sender could not publish its idle epoch")

    def _send(self, batches: list[_Batch]) -> list[list[tuple] | None]:
        """Send batches in order, as few requests as the op bound allows; per batch, the
        digest of the results the session applies ((kind, value, items)), or None for a
        batch the daemon did not take (another generation, or the connection failed)."""
        answers: list[list[tuple] | None] = [None] * len(batches)
        wire: list[kvd_pb2.StepOp] = []
        owner: list[int] = []
        generation = self.client.generation
        for n, batch in enumerate(batches):
            if batch.generation != generation:
                continue
            answers[n] = []
            for op in batch.ops:
                step_ops = _wire(op)
                wire.extend(step_ops)
                owner.extend([n] * len(step_ops))
        if not self.client.available:
            return [None] * len(batches)
        for i in range(0, len(wire), MAX_OPS_PER_STEP):
            part_ops = wire[i:i + MAX_OPS_PER_STEP]
            part = self.client.step(part_ops)
            if part is None:
                for n in set(owner[i:]):
                    answers[n] = None
                return answers
            for op, result, n in zip(part_ops, part, owner[i:i + MAX_OPS_PER_STEP],
                                     strict=False):
                kind = op.WhichOneof("op")
                digest = answers[n]
                if digest is None:
                    continue
                if kind == "grant":
                    digest.append(("grant", op.grant.count, list(result.grant.slot_offsets)))
                elif kind == "reset":
                    digest.append(("reset", result.reset.epoch, None))
                elif kind == "take_events":
                    digest.append(("take_events", 0, [
                        Event(tuple(e.keys), e.removed, e.metadata_only)
                        for e in result.take_events.events]))
        return answers

    def _publish_idle(self) -> None:
        """Between steps with no load in flight this session acts on no index entry: publish
        0 ("nothing"), so an idle engine holds back no freed slot however long it stays idle
        (an epoch published now would hold every slot freed after it until its next step).
        Safe: the next step publishes its epoch, then fences, before its first lookup."""
        with self._lock:
            if self._in_step or self._load_epochs or self._stale_epochs or self._marks is None or \
                    self._generation != self.client.generation:
                return
            self._marks.publish(0)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._outbox.put(None)
            self._sender.join(timeout=5)
            self._close_index()
