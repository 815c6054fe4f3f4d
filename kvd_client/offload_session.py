"""The offload protocol of one engine, engine-neutral: nothing here ever waits for the daemon,
and nothing here needs another thread of the engine to run.

An engine's scheduler asks, every step, which blocks are cached, pins the ones it loads,
reserves slots for the ones it stores and reports what finished. `OffloadSession` answers all
of that from local state, on the scheduler thread itself:

- lookups read the namespace's shared index (kvd_client/index_reader.py) directly;
- a HIT stays loadable without a pin round trip: the session publishes, before each step's
  lookups, the oldest reclaim epoch it may still act on (its loads in flight,
  kvd_client/loads.py), and the daemon reuses a freed slot only after every reader has moved
  past it;
- stores go to slots the daemon granted in advance, a reserve sized from the store rate the
  session sees (kvd_client/reserve.py);
- everything the daemon must hear (pins for its eviction order, stores, completions, request
  ends, grant requests, lookup counts, event pulls) is written as records into the session's
  channel at the step's end (kvd_client/channel.py: shared-memory rings, no system call in
  the common case), and the daemon's answers are read from it at the next step's start.

A dead, stopped or slow daemon costs a step nothing: lookups answer MISS and stores are
declined until the client is back. The vLLM plug-in (kvd_client/vllm/manager.py) only
translates vLLM's calls to these; another engine can drive it the same way (docs/client.md).
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvd_proto import kvd_pb2
from kvd_proto import records as rec
from kvd_proto.native import Lookups

from . import messages
from .channel import Outbox, SessionChannel
from .client import KvdClient
from .index_reader import STATE_READY, IndexReader, Marks
from .loads import LoadTracker
from .reserve import DEFAULT_FLOOR, DEFAULT_INITIAL, StoreReserve

log = logging.getLogger(__name__)

DEFAULT_RESERVE = 0             # 0: sized from the store rate; N > 0: never below N slots
MAX_LOCAL_STORES = 1 << 16
UNKNOWN_EPOCH = -1              # a store made while a reset is on its way to the daemon
MAX_EVENTS_PER_ASK = 65536


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


@dataclass(slots=True)
class _Stores:
    """What the stores of one `reserve` call share."""

    reset_epoch: int
    seq: int                    # the step whose records told the daemon about them


_Store = tuple[int, _Stores]    # a store in flight: (slot offset, its call's record)


@dataclass(slots=True)
class _Connection:
    """What a (re)connection set up, for the next step to adopt."""

    generation: int
    index: IndexReader
    marks: Marks
    channel: SessionChannel
    offsets: list[int]

    def close(self) -> None:
        self.index.close()
        self.marks.close()
        self.channel.close()


class OffloadSession:
    """One engine's offload session over a `KvdClient` (see the module doc)."""

    def __init__(self, client: KvdClient, *, reserve: int = DEFAULT_RESERVE,
                 initial_reserve: int = 0, enable_events: bool = False,
                 answers: tuple[Any, Any, Any] = (Lookup.MISS, Lookup.HIT, Lookup.PENDING)
                 ) -> None:
        """`reserve`: 0 sizes the slots held for stores from the store rate; N > 0 keeps at
        least N. `initial_reserve`: what to hold before any store was seen (0: `reserve`, or
        a default; an engine that knows how many blocks one step may store passes twice
        that). `answers`: what `lookup` returns for a miss, a hit and a pending store; an
        engine may pass its own values, so that its scheduler can call `lookup` directly (it
        is the hottest call: once per chunk of every waiting request, every step)."""
        self.client = client
        self._miss, self._hit, self._pending = answers
        self._reserve = StoreReserve(reserve or DEFAULT_FLOOR,
                                     initial_reserve or reserve or DEFAULT_INITIAL)
        self.enable_events = enable_events
        self._generation = -1
        self._index: IndexReader | None = None
        self._marks: Marks | None = None
        self._channel: SessionChannel | None = None
        self._per_record = 1          # keys one record carries (this session's key width)
        self._reset_epoch = 0
        self._pool_id = ""
        # step state (scheduler thread)
        self._in_step = False
        self._step_epoch = 0
        self._hits: dict[bytes, int] = {}                       # this step's HITs -> offset
        self._seq = 0                 # the step whose records are being made
        self._acked = -1              # the last step whose records the daemon has read
        self._outbox = Outbox()
        self._essential = False       # this step made a record the engine waits for
        self._loads = LoadTracker()
        self._stores: dict[bytes, _Store] = {}       # key -> store in flight (or not settled)
        self._completed: set[bytes] = set()           # of those, the copies that finished
        # completed stores in completion order, (seq, key, store), to forget once the daemon
        # has read them (the index answers from then on)
        self._settling: collections.deque[tuple[int, bytes, _Store]] = collections.deque()
        self._events: list[Event] = []
        self._reset_pending = 0       # the token of the reset asked for (0: none)
        self._reset_tokens = 0
        self._stale_stores: dict[int, list[bytes]] = {}
        self._deferred: list[tuple[bytes, str, bool]] = []   # completions awaiting an epoch
        self._old_sessions: list[str] = []        # ended sessions whose copies still run
        self._old_copies = 0
        # Lookups the index alone decides (HIT, MISS) are answered in C where it was built
        # (kvd_proto/native.py), everything else by `_lookup_slow`; the answers are counted
        # there, and the daemon hears the counts.
        self._lookups = Lookups(self._hits, self._stores, self._miss, self._hit,
                                self._lookup_slow)
        self.lookup = self._lookups.lookup        # vLLM calls it once per chunk
        self._reported = (0, 0, 0)
        self._rejections = 0
        self._last_warning = 0.0
        self._lock = threading.Lock()             # the handoff, set by the connecting thread
        self._handoff: _Connection | None = None
        self._closed = False
        client.on_reconnect = self._on_connect
        if client.available:
            self._on_connect()

    def _on_connect(self) -> None:
        """A new session with the daemon (whichever thread connects: the constructor's or the
        client's background thread, never a step): map its index and channel and take the
        first grant now, so the first step already answers lookups and stores."""
        generation = self.client.generation
        mapped = self.client.map_index()
        if mapped is None:
            return
        chan = self.client.map_channel()
        if chan is None:
            for fd in mapped:
                os.close(fd)
            return
        try:
            index = IndexReader(mapped[0])
        except (OSError, ValueError) as exc:
            for fd in (*mapped, *chan):
                os.close(fd)
            log.error("kvd daemon handed over an index this client cannot read (%s); "
                      "offload stays off for this session", exc)
            return
        try:
            channel = SessionChannel(*chan)
        except (OSError, ValueError) as exc:
            index.close()
            for fd in (mapped[1], *chan):
                os.close(fd)
            log.error("kvd daemon handed over a channel this client cannot use (%s); "
                      "offload stays off for this session", exc)
            return
        # Its marks stay 0 ("nothing read") until the first step publishes an epoch.
        connection = _Connection(generation, index, Marks(mapped[1]), channel, [])
        results = self.client.step([kvd_pb2.StepOp(grant=kvd_pb2.GrantRequest(
            count=self._reserve.initial))])
        if results:
            connection.offsets = list(results[0].grant.slot_offsets)
        with self._lock:
            stale, self._handoff = self._handoff, connection
        if stale is not None:
            stale.close()

    # ------------------------------------------------------------------ state
    @property
    def available(self) -> bool:
        return self.client.available and self._index is not None

    @property
    def pool_id(self) -> str:
        return self._pool_id

    @property
    def reserve_target(self) -> int:
        return self._reserve.target

    @property
    def acked_steps(self) -> int:
        """Steps whose every record the daemon has read (as of the last answers read)."""
        return self._acked + 1

    @property
    def messages_sent(self) -> int:
        """Records written to the daemon so far (every session of this engine)."""
        return self._outbox.sent

    def _sync(self) -> None:
        """A new session (reconnect) replaces everything learned from the old one."""
        generation = self.client.generation
        if generation == self._generation:
            return
        old_session = self.client.previous_session_id
        copies = len(self._loads) + len(self._stores)
        if old_session and copies:
            self._old_sessions.append(old_session)
            self._old_copies += copies
        self._generation = generation
        self._close_connection()
        self._hits.clear()
        self._loads.clear()
        self._clear_stores()
        self._reserve.clear()
        self._outbox.clear()
        self._reset_pending = 0
        self._stale_stores.clear()
        self._deferred.clear()
        self._adopt()

    def _adopt(self) -> None:
        """Take over what the connection set up for the current client generation."""
        with self._lock:
            handoff = self._handoff
            if handoff is None or handoff.generation != self._generation or \
                    self._index is not None:
                return
            self._handoff = None
        self._index, self._marks, self._channel = handoff.index, handoff.marks, handoff.channel
        self._lookups.bind(handoff.index.mapping, *handoff.index.header.geometry)
        self._per_record = messages.per_record(handoff.channel.writer.max_record,
                                               handoff.index.header.key_width)
        self._reserve.size_for(handoff.index.header.capacity)
        self._reserve.slots.extend(handoff.offsets)
        self._pool_id = self.client.pool_id or ""

    def _close_connection(self) -> None:
        self._lookups.unbind()
        for part in (self._index, self._marks, self._channel):
            if part is not None:
                part.close()
        self._index = self._marks = self._channel = None

    def _begin(self) -> None:
        """The first call of a step: apply the daemon's answers, then publish the epoch this
        step's lookups may act on (before any of them reads the index)."""
        if self._in_step:
            return
        self._sync()
        if self._index is None:
            self._adopt()
        self._receive()
        self._reserve.begin_step()
        self._in_step = True
        if self._index is not None and self._marks is not None:
            self._step_epoch = self._index.reclaim_epoch
            if not self._reset_pending:
                self._reset_epoch = self._index.reset_epoch
            self._marks.publish(self._loads.floor(self._step_epoch))
        # From here the compiled path answers what the index alone decides.
        self._lookups.enabled = int(self._index is not None and not self._reset_pending
                                    and self.client.available)

    # --------------------------------------------------------------- lookups
    def lookup(self, key: bytes, _context: object = None) -> Any:
        """Whether `key` is cached: HIT (loadable now), PENDING (being stored) or MISS (as
        the `answers` given at construction). `_context` is ignored (an engine's per-request
        argument, so the engine can call this method directly). Each instance replaces this
        method with its `Lookups.lookup` (the same answers, compiled where built)."""
        return self._lookups.lookup(key)

    def _lookup_slow(self, key: bytes) -> Any:
        """`lookup` where the index alone does not decide (or outside a step, or with no
        index): the engine's own stores in flight, a pending reset, no daemon."""
        if not self._in_step:
            self._begin()
            if self._lookups.enabled:
                return self._lookups.lookup(key)
        counts = self._lookups
        counts.lookups += 1
        if self._index is None or self._reset_pending or not self.client.available:
            counts.misses += 1
            return self._miss
        found = counts.find(key)
        if found is not None:
            state, offset = found
            if state == STATE_READY:
                self._hits[key] = offset
                counts.hits += 1
                return self._hit
            store = self._stores.get(key)
            if store is not None and store[0] == offset and key in self._completed:
                self._hits[key] = offset              # ours, completed: the daemon catches up
                counts.hits += 1
                return self._hit
            return self._pending
        store = self._stores.get(key)
        if store is not None and store[1].seq > self._acked:
            # The daemon has not read this store yet: the slot is still ours alone.
            if key in self._completed:
                self._hits[key] = store[0]
                counts.hits += 1
                return self._hit
            return self._pending
        counts.misses += 1
        return self._miss

    @property
    def lookups_total(self) -> int:
        """Lookups answered (every session of this engine), as the daemon's stats count."""
        return self._lookups.lookups

    @property
    def hits_total(self) -> int:
        return self._lookups.hits

    @property
    def misses_total(self) -> int:
        return self._lookups.misses

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
        if not keys:
            return []
        found = self._lookups.offsets_of(keys)
        if found is not None:                    # the common case: every key was a HIT
            offsets: list[int | None] = found
            loaded, loaded_offsets = keys, found
        else:
            offsets = list(map(self._hits.get, keys))
            loaded = [k for k, o in zip(keys, offsets, strict=True) if o is not None]
            loaded_offsets = [o for o in offsets if o is not None]
            if not loaded:
                return offsets
        distinct = self._loads.pin(loaded, (self._step_epoch, self._reset_epoch, req_id))
        pos = positions if positions and len(positions) == len(keys) else None
        if pos and len(loaded) != len(keys):
            pos = [p for p, o in zip(pos, offsets, strict=True) if o is not None]
        self._put(messages.pin(loaded, req_id, pos, loaded_offsets,  # type: ignore[arg-type]
                               self._per_record, distinct))
        return offsets

    def unpin(self, keys: Sequence[bytes], req_id: str = "") -> None:
        """Loads of `keys` finished (every worker copied)."""
        by_reset, unknown = self._loads.unpin(keys, req_id)
        for _ in range(unknown):
            self._finished_old_copy()
        if not self._loads.holding:
            self._publish_idle()
        for reset, group in by_reset.items():
            self._put(messages.complete_load(group, req_id, reset, self._per_record,
                                             distinct=True))

    # ----------------------------------------------------------------- stores
    def reserve(self, keys: Sequence[bytes], req_id: str = "",
                positions: Sequence[int] | None = None) -> list[tuple[bytes, int]] | None:
        """Slots for the offered keys that are new: [(key, offset)] (keys stored or being
        stored already are left out), or None when the reserve cannot hold them all now."""
        stored = self.store_slots(keys, req_id, positions)
        return None if stored is None else list(zip(*stored, strict=True))

    def store_slots(self, keys: Sequence[bytes], req_id: str = "",
                    positions: Sequence[int] | None = None
                    ) -> tuple[list[bytes], list[int]] | None:
        """`reserve` as two lists: the new keys and their slots' offsets (what an engine's
        store spec wants), or None when the reserve cannot hold them all now."""
        self._begin()
        if self._index is None or not self.client.available:
            return [], []
        stores = self._stores
        # Until the daemon has done a reset this session asked for, the index still shows
        # what the reset drops: only this session's own later stores count as present.
        new = self._lookups.find_new(keys, not self._reset_pending)
        slots = self._reserve.take(len(new))
        if slots is None:
            return None
        if not new:
            return new, slots
        # During a reset this session asked for, the stores' epoch is the reset's answer:
        # UNKNOWN_EPOCH until it arrives.
        shared = _Stores(UNKNOWN_EPOCH if self._reset_pending else self._reset_epoch,
                         self._seq)
        if len(new) <= MAX_LOCAL_STORES - len(stores):
            stores.update(zip(new, zip(slots, [shared] * len(new), strict=True), strict=True))
        else:
            for key, offset in zip(new[:max(0, MAX_LOCAL_STORES - len(stores))], slots,
                                   strict=False):
                stores[key] = (offset, shared)
        pos = positions if positions and len(positions) == len(keys) else None
        self._put(messages.store(keys, req_id, pos, new, slots, self._per_record))
        return new, slots

    def complete_store(self, keys: Sequence[bytes], req_id: str = "",
                       success: bool = True) -> None:
        """Stores of `keys` finished (every worker wrote its share)."""
        by_reset: dict[int, list[bytes]] = {}
        stores, completed, settling = self._stores, self._completed, self._settling
        for key in keys:
            store = stores.get(key)
            if store is None:
                self._finished_old_copy()
                continue
            shared = store[1]
            if success:
                completed.add(key)           # lookups answer HIT from now on
                settling.append((shared.seq, key, store))
            else:
                del stores[key]
                completed.discard(key)
            if shared.reset_epoch == UNKNOWN_EPOCH:
                self._deferred.append((key, req_id, success))
                continue
            by_reset.setdefault(shared.reset_epoch, []).append(key)
        for reset, group in by_reset.items():
            self._put(messages.complete_store(group, success, req_id, reset, self._per_record))

    # ---------------------------------------------------------- request scope
    def touch(self, keys: Sequence[bytes], req_id: str = "") -> None:
        if keys:
            self._put(messages.touch(keys, req_id, self._per_record))

    def request_finished(self, req_id: str) -> None:
        self._put([rec.encode_request_finished(req_id)])

    # ------------------------------------------------------------------ resets
    def reset(self) -> None:
        """Drop every block of the namespace; copies in flight finish harmlessly."""
        self._sync()
        if not self.available:
            return
        self._reset_tokens += 1
        self._reset_pending = self._reset_tokens
        self._lookups.enabled = 0
        self._put([rec.encode_reset(self._reset_pending)])
        for key, (_, shared) in self._stores.items():
            self._stale_stores.setdefault(shared.reset_epoch, []).append(key)
        self._clear_stores()
        self._loads.reset()
        self._hits.clear()

    def reset_flushed(self) -> None:
        """Every copy that was in flight at the last reset has finished: release their slots
        at the daemon (it kept them, as zombies, until now)."""
        for reset, keys in self._stale_stores.items():
            self._put(messages.complete_store(keys, False, "", reset, self._per_record))
        for reset, keys in self._loads.reset_flushed().items():
            for key in keys:          # one per load: a key may have several in flight
                self._put([rec.encode_complete_load([key], "", reset)])
        self._stale_stores.clear()

    # ------------------------------------------------------------------ events
    def take_events(self) -> list[Event]:
        if not self.enable_events:
            return []                # nothing asks the daemon for events
        self._receive()
        events, self._events = self._events, []
        return events

    # --------------------------------------------------------------- the step
    def end_step(self) -> None:
        """The step is over: this step's HITs lapse and its records go to the daemon."""
        self._sync()
        self._in_step = False
        self._lookups.enabled = 0
        self._hits.clear()
        self._publish_idle()
        if not self.available:
            self._outbox.clear()
            return
        reserve = self._reserve
        reserve.end_step()
        told = reserve.to_send()
        if told is not None:
            self._put([rec.encode_reserve(*told)], essential=False)
        surplus = reserve.surplus()
        if surplus:
            self._put(messages.return_slots(surplus), essential=False)
        self._report_counts()
        if self.enable_events and self._essential:
            self._put([rec.encode_take_events(MAX_EVENTS_PER_ASK)])
        self._essential = False
        self._flush()
        self._seq += 1

    def has_pending_work(self) -> bool:
        """Records not yet read by the daemon, or a reset not yet answered (keep the engine
        stepping until they are)."""
        if self._channel is not None and self._outbox.waiting():
            self._flush()
        self._receive()
        return bool(self._reset_pending) or self._outbox.unread(self._channel)

    def _report_counts(self) -> None:
        """The lookups answered since the last report, for the daemon's stats."""
        counts = (self.lookups_total, self.hits_total, self.misses_total)
        if counts != self._reported:
            delta = [now - then for now, then in zip(counts, self._reported, strict=True)]
            self._reported = counts
            self._put([rec.encode_counters(*delta)], essential=False)

    def _put(self, records: list[bytes], essential: bool = True) -> None:
        if not self.client.available or self._channel is None:
            return
        for data in records:
            self._outbox.put(self._seq, data, essential)
        self._essential |= essential

    def _flush(self) -> None:
        channel = self._channel
        if channel is None:
            return
        self._outbox.flush(channel)
        if self._outbox.overflowing:
            log.error("kvd daemon reads none of this engine's messages (%d waiting); "
                      "restarting the session", self._outbox.waiting())
            self._outbox.clear()
            self.client.restart("the daemon does not keep up with this engine's messages")

    def _finished_old_copy(self) -> None:
        """A copy of an earlier session finished; when the last one does, the daemon may
        release what it held for that session (its process lives on: this one)."""
        if self._old_copies:
            self._old_copies -= 1
            if not self._old_copies:
                for session_id in self._old_sessions:
                    self._put([rec.encode_release_held(session_id)])
                self._old_sessions.clear()

    # ---------------------------------------------------------- answers
    def _receive(self) -> None:
        """Apply what the daemon answered since the last call."""
        channel = self._channel
        if channel is None or self._generation != self.client.generation:
            return
        for answer in channel.receive():
            if isinstance(answer, rec.Granted):
                self._reserve.granted(answer.offsets)
            elif isinstance(answer, rec.ResetDone):
                if answer.token == self._reset_pending:
                    self._reset_done(answer.epoch)
            elif isinstance(answer, rec.Events):
                self._events.extend(Event(keys, removed, metadata_only)
                                    for keys, removed, metadata_only in answer.events)
            else:
                self._rejected(answer)
        self._acked = self._outbox.acked(channel, self._seq)
        self._forget_settled_stores()

    def _rejected(self, answer: rec.Rejected) -> None:
        """A record the daemon refused: a bug here or a stale epoch; the rest goes on."""
        self._rejections += 1
        if answer.kind == rec.RESET and self._reset_pending:
            self._reset_done(self._reset_epoch)
        now = time.monotonic()
        if now - self._last_warning > 10:
            self._last_warning = now
            log.warning("kvd rejected a %s message: %s: %s (%d so far)",
                        rec.UP_KINDS.get(answer.kind, answer.kind), answer.code, answer.message,
                        self._rejections)

    def _reset_done(self, epoch: int) -> None:
        """The daemon did the reset: the stores made meanwhile belong to its new epoch."""
        self._reset_pending = 0
        self._reset_epoch = epoch
        for _, shared in self._stores.values():
            if shared.reset_epoch == UNKNOWN_EPOCH:
                shared.reset_epoch = epoch
        deferred, self._deferred = self._deferred, []
        for key, req_id, success in deferred:
            self._put(messages.complete_store([key], success, req_id, epoch, self._per_record))

    def _forget_settled_stores(self) -> None:
        """Completed stores the daemon has read are answered by the index from now on (in
        completion order: one not read yet keeps the later ones a little longer, which only
        sends their lookups down the slow path)."""
        acked, settling, stores = self._acked, self._settling, self._stores
        while settling and settling[0][0] <= acked:
            _, key, store = settling.popleft()
            if stores.get(key) is store:
                del stores[key]
                self._completed.discard(key)

    def _clear_stores(self) -> None:
        self._stores.clear()
        self._completed.clear()
        self._settling.clear()

    def _publish_idle(self) -> None:
        """Between steps with no load in flight this session acts on no index entry: publish
        0 ("nothing"), so an idle engine holds back no freed slot however long it stays idle
        (an epoch published now would hold every slot freed after it until its next step).
        Safe: the next step publishes its epoch, then fences, before its first lookup."""
        if self._in_step or self._loads.holding or self._marks is None or \
                self._generation != self.client.generation:
            return
        self._marks.publish(0)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._channel is not None and self.client.available:
                self._report_counts()
                self._outbox.flush(self._channel)     # its last completions and counts
            self._close_connection()
            with self._lock:
                stale, self._handoff = self._handoff, None
            if stale is not None:
                stale.close()
