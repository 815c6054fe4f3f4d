"""The offload protocol of one engine, engine-neutral: nothing here ever waits for the daemon,
and nothing here needs another thread of the engine to run.

An engine's scheduler asks, every step, which blocks are cached, pins the ones it loads,
reserves slots for the ones it stores and reports what finished. `OffloadSession` answers all
of that from local state, on the scheduler thread itself:

- lookups read the namespace's shared index (kvd_client/link/index_reader.py) directly; a key
  only a tier below the pool holds answers HIT_PENDING and is promoted by the daemon
  (kvd_client/offload/promotions.py), then reads HIT from the index; in a namespace shared
  through a cluster store, a key held nowhere on the node is asked about (one FIND record a
  step, kvd_client/offload/finds.py) and answers "not known yet" until the daemon's answer;
- loads and stores (kvd_client/offload/transfers.py, this class's base) run their common
  case compiled in one pass over the keys;
- a HIT stays loadable without a pin round trip: the session publishes, before each step's
  lookups, the oldest reclaim epoch it may still act on (its loads in flight,
  kvd_client/offload/loads.py), and the daemon reuses a freed slot only after every reader has moved
  past it;
- stores go to slots the daemon granted in advance, a reserve sized from the store rate the
  session sees (kvd_client/offload/reserve.py);
- everything the daemon must hear (pins for its eviction order, stores, completions, request
  ends, grant requests, lookup counts, event pulls) is written as records into the session's
  channel at the step's end (kvd_client/link/channel.py: shared-memory rings, no system call in
  the common case), and the daemon's answers are read from it at the next step's start, both
  through the session's one link to its daemon (kvd_client/offload/daemon_link.py).

A dead, stopped or slow daemon costs a step nothing: lookups answer MISS and stores are
declined until the client is back. The vLLM plug-in (kvd_client/vllm/manager.py) only
translates vLLM's calls to these; another engine can drive it the same way (docs/client.md).
"""

from __future__ import annotations

import enum
import logging
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvd_client.client import KvdClient
from kvd_client.link import messages
from kvd_client.link.connection import Handoff, connect
from kvd_client.link.index_reader import STATE_READY, BelowMap, IndexReader, Marks
from kvd_client.offload.daemon_link import DaemonLink
from kvd_client.offload.event_inbox import Event, EventInbox
from kvd_client.offload.finds import Finds
from kvd_client.offload.hints import HintError, parse_hint
from kvd_client.offload.loads import LoadTracker
from kvd_client.offload.old_copies import OldCopies
from kvd_client.offload.promotions import Promotions
from kvd_client.offload.reserve import DEFAULT_FLOOR, DEFAULT_INITIAL, StoreReserve
from kvd_client.offload.resets import Resets
from kvd_client.offload.stores import StoreTracker
from kvd_client.offload.transfers import SessionTransfers
from kvd_proto import records as rec
from kvd_proto.below_layout import FLAG_ASK, FLAG_WAIT
from kvd_proto.native import Lookups, steps_of
from kvd_proto.ratelog import RateLimitedLog
from kvd_proto.wire import BlockState

log = logging.getLogger(__name__)

DEFAULT_RESERVE = 0             # 0: sized from the store rate; N > 0: never below N slots
MAX_EVENTS_PER_ASK = 65536


# What `OffloadSession.lookup` answers by default: the wire's block states (kvd_proto's
# BlockState: MISS, HIT, HIT_PENDING, being stored or promoted and not readable yet, vLLM's
# name), made from them and valued by their lower-case names, as engines print them. A type
# checker reads the same members spelled out (tests/unit/test_wire_shelf.py holds the two equal).
if TYPE_CHECKING:
    class Lookup(enum.Enum):
        MISS = "miss"
        HIT = "hit"
        HIT_PENDING = "hit_pending"
else:
    Lookup = enum.Enum("Lookup", [(state.name, state.name.lower()) for state in BlockState],
                       module=__name__)


class OffloadSession(SessionTransfers):
    """One engine's offload session over a `KvdClient` (see the module doc)."""

    def __init__(self, client: KvdClient, *, reserve: int = DEFAULT_RESERVE,
                 initial_reserve: int = 0, enable_events: bool = False,
                 keep_evicted: bool = True,
                 answers: tuple[Any, ...] = (Lookup.MISS, Lookup.HIT, Lookup.HIT_PENDING)
                 ) -> None:
        """`reserve`: 0 sizes the slots held for stores from the store rate; N > 0 keeps at
        least N. `initial_reserve`: what to hold before any store was seen (0: `reserve`, or
        a default; an engine that knows how many blocks one step may store passes twice
        that). `keep_evicted` (default True): blocks the daemon evicted into this session's
        reserve stay its hits until it stores into their slots (docs/attach.md, kept blocks).
        `answers`: what `lookup` returns for a miss, a hit and a pending store, and
        optionally a fourth for "not known yet, ask again next step" (vLLM's RETRY: a key
        the cluster store is being asked about, kvd_client/offload/finds.py; the pending
        answer without one); an engine may pass its own values, so that its scheduler can
        call `lookup` directly (it is the hottest call: once per chunk of every waiting
        request, every step)."""
        self.client = client
        self._miss, self._hit, self._pending = answers[:3]
        self._retry = answers[3] if len(answers) > 3 else self._pending
        self._reserve = StoreReserve(reserve or DEFAULT_FLOOR,
                                     initial_reserve or reserve or DEFAULT_INITIAL,
                                     keep_evicted=keep_evicted)
        self.enable_events = enable_events
        self._generation = -1
        self._index: IndexReader | None = None
        self._marks: Marks | None = None
        self._below: BelowMap | None = None
        self._per_record = 1          # keys one record carries (this session's key width)
        self._pool_id = ""
        # step state (scheduler thread)
        self._in_step = False
        self._step_epoch = 0
        # the REQUEST_FINISHED records of the requests that ended this step (encoded when the
        # engine says so: its id is at hand then, cold again by the step's end)
        self._finished: list[bytes] = []
        self._loads = LoadTracker()
        self._stores = StoreTracker()
        self._events = EventInbox()
        self._promotions = Promotions()
        self._finds = Finds()
        self._resets = Resets(self._stores, self._loads)      # a reset asked for, its epoch
        self._old = OldCopies()       # copies of ended sessions, until the daemon may release
        # The one link to the daemon: this step's records (`seq`), the channel, what the
        # daemon has read (`acked`), its answers applied.
        self._link = DaemonLink(client, self._reserve, self._events, self._resets,
                                self._stores, self._finds)
        self._put = self._link.put    # records for the daemon, sent at the step's end
        self._post = self._link.records.append    # one record of a compiled call, in order
        # Lookups the index alone decides (HIT, MISS) are answered in C where it was built
        # (kvd_proto/native.py), everything else by `_lookup_slow`; the answers are counted
        # there, and the daemon hears the counts.
        self._lookups = Lookups(self._stores.stores, self._miss, self._hit, self._lookup_slow,
                                self._reserve.kept)
        self._restores: list[tuple[bytes, int]] = []   # blocks taken back this step
        # vLLM: once per chunk, straight into the lookups (the context passed by position)
        self.lookup = self._lookups.lookup  # type: ignore[method-assign,assignment]
        # The scheduler's steps compiled (kvd_proto/_steps.c) where built; else None, and the
        # Python path of transfers.py, stores.py and loads.py, their one twin, does it all.
        self._steps = steps_of(self._lookups)
        if self._steps is not None:
            self._stores.forget = self._steps.settle
        self._handoff = Handoff()                 # what the connecting thread set up
        self._closed = False
        self.hints_sent = 0
        self._hint_log = RateLimitedLog(log)
        self._id_log = RateLimitedLog(log)
        client.on_reconnect = self._on_connect
        if client.available:
            self._on_connect()

    def _on_connect(self) -> None:
        """A new session with the daemon (see kvd_client/link/connection.py): its index, channel
        and first slots, for the next step to adopt, so it answers lookups and stores."""
        connection = connect(self.client, self._reserve.initial)
        if connection is not None:
            self._handoff.put(connection)

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
    def reserve_held(self) -> int:
        """Granted slots held now: what `store_slots` can take at once."""
        return len(self._reserve)

    @property
    def acked_steps(self) -> int:
        """Steps whose every record the daemon has read (as of the last answers read)."""
        return self._link.acked + 1

    @property
    def messages_sent(self) -> int:
        """Records written to the daemon so far (every session of this engine)."""
        return self._link.sent

    def _sync(self) -> None:
        """A new session (reconnect) replaces everything learned from the old one."""
        generation = self.client.generation
        if generation == self._generation:
            return
        self._old.ended(self.client.previous_session_id, len(self._loads) + len(self._stores))
        self._generation = generation
        self._close_connection()
        self._link.drop()                         # made for the old session
        self._lookups.clear_hits()
        self._finished.clear()                    # the old session's requests went with it
        self._loads.clear()
        self._stores.clear()
        self._promotions.clear()
        self._finds.clear()
        self._restores.clear()
        self._reserve.clear()
        self._resets.clear()
        self._adopt()

    def _adopt(self) -> None:
        """Take over what the connection set up for the current client generation."""
        if self._index is not None:
            return
        handoff = self._handoff.take(self._generation)
        if handoff is None:
            return
        self._index, self._marks, self._below = handoff.index, handoff.marks, handoff.below
        self._link.attach(handoff.channel)
        self._lookups.bind(handoff.index.mapping, *handoff.index.header.geometry)
        if handoff.below is not None:
            self._lookups.bind_below(handoff.below.mapping)
        self._per_record = messages.per_record(handoff.channel.writer.max_record,
                                               handoff.index.header.key_width)
        self._reserve.size_for(handoff.index.header.capacity)
        self._reserve.slots.extend(handoff.offsets)
        self._pool_id = self.client.pool_id or ""
        self._put(self._old.release_records())

    def _close_connection(self) -> None:
        self._lookups.unbind()
        for part in (self._index, self._marks, self._link.channel, self._below):
            if part is not None:
                part.close()
        self._index = self._marks = self._below = None
        self._link.attach(None)

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
            self._resets.follow(self._index.reset_epoch)
            self._marks.publish(self._loads.floor(self._step_epoch))
        # From here the compiled path answers what the index alone decides.
        self._lookups.enabled = int(self._index is not None and not self._resets.pending
                                    and self.client.available)

    # --------------------------------------------------------------- lookups
    def lookup(self, key: bytes, _context: object = None) -> Any:
        """Whether `key` is cached: HIT (loadable now), HIT_PENDING (being stored) or MISS (as
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
        if self._index is None or self._resets.pending or not self.client.available:
            counts.misses += 1
            return self._miss
        found = counts.find(key)
        if found is not None and found[0] == STATE_READY:
            own: int | None | bool = found[1]
        else:
            own = self._stores.answer(key, found, self._link.acked)
        if own is None and found is None and key in self._reserve.kept:
            own = self._kept(key)
        if own is None and found is None and self._promotions.answer(
                key, self._link.seq, self._link.acked, counts.below, counts.find):
            own = True                               # held below: promoted on request
        if own is True:
            return self._pending
        if own is None and found is None:
            flags = self._lookups.below_flags()
            if flags & FLAG_ASK and self._finds.answer(key, self._link.seq) \
                    and flags & FLAG_WAIT:
                return self._retry                # the store is being asked: next step
        if own is None:
            counts.misses += 1
            return self._miss
        self._lookups.hit(key, own)
        counts.hits += 1
        return self._hit

    def _kept(self, key: bytes) -> bool | None:
        """`key` is an evicted block a granted slot of this session still holds (or one it
        is taking back): True (pending: the index shows it once the daemon has read the
        RESTORE this step sends), None when the slot went to a store meanwhile."""
        seq = self._link.seq
        value = self._reserve.kept.get(key)
        if value is not None and value < 0:
            return True                              # taken back: the daemon has not read it
        offset = self._reserve.reclaim(key, seq)
        if offset is None:
            return None
        self._restores.append((key, offset))
        return True

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
        return self._lookups.hit_offset(key)

    # ---------------------------------------------------------- request scope
    def touch(self, keys: Sequence[bytes], req_id: str = "") -> None:
        if keys:
            self._put(messages.touch(keys, req_id, self._per_record))

    def hint(self, req_id: str, params: object) -> bool:
        """A new request's per-request parameters (vLLM: its kv_transfer_params): its agent
        session's retention hint, if it has one (kvd_client/offload/hints.py), goes to the
        daemon before the request's other records. A malformed one is refused for this
        request alone (counted in `hints_refused`, logged once per interval). True: sent."""
        try:
            hint = parse_hint(params)
        except HintError as exc:
            self._hint_log.warning("kvd: the retention hint of request %r is refused: %s",
                                   str(req_id)[:64], exc)
            return False
        if hint is None or not self.client.available:
            return False
        self._sync()                 # a request may come before the session's first step
        if self._index is None:
            self._adopt()
        if self._link.channel is None:
            return False             # not connected yet: the request goes on without
        self._put([rec.encode_hint(req_id, hint.session, hint.retain_ms)])
        self.hints_sent += 1
        return True

    @property
    def hints_refused(self) -> int:
        return self._hint_log.total

    def request_finished(self, req_id: str) -> None:
        """The request is over: the daemon hears it with the step's records (after every
        other record of the step, so after the request's own)."""
        if self.client.available:
            try:
                self._finished.append(rec.encode_request_finished(
                    req_id if type(req_id) is str else str(req_id)))
            except (struct.error, UnicodeError) as exc:   # an id no record carries
                self._id_log.warning("kvd: request id %r... cannot be sent (%s); the daemon "
                                     "lets go of its state when the session ends",
                                     str(req_id)[:64], exc)

    # ------------------------------------------------------------------ resets
    def reset(self) -> None:
        """Drop every block of the namespace; copies in flight finish harmlessly."""
        self._sync()
        if not self.available:
            return
        self._lookups.enabled = 0
        self._resets.ask(self._put)
        self._promotions.clear()
        # The reset drops those blocks too (a RESTORE already made still goes: the daemon
        # frees its slot, which left the reserve).
        self._reserve.forget_kept()
        self._lookups.clear_hits()

    def reset_flushed(self) -> None:
        """Every copy that was in flight at the last reset has finished: release their slots
        at the daemon (it kept them, as zombies, until now)."""
        self._resets.flushed(self._put, self._per_record)

    # ------------------------------------------------------------------ events
    def take_events(self) -> list[Event]:
        if not self.enable_events:
            return []                # nothing asks the daemon for events
        self._receive()
        return self._events.take()

    @property
    def events_dropped(self) -> int:
        """Events the daemon dropped before this engine took them (nobody took them in time:
        the daemon bounds what waits), so what take_events returned is incomplete."""
        return self._events.dropped

    # --------------------------------------------------------------- the step
    def end_step(self) -> None:
        """The step is over: this step's HITs lapse and its records go to the daemon."""
        self._sync()
        self._in_step = False
        self._lookups.enabled = 0
        self._lookups.clear_hits()
        self._publish_idle()
        if not self.available:
            self._link.discard()                  # none of it will be read
            self._finished.clear()
            return
        if self._finished:
            self._put(self._finished)
            self._finished.clear()
        if self._restores:
            self._put(messages.restore(self._restores, self._per_record))
            self._restores.clear()
        self._put(self._reserve.step_records(), essential=False)
        promote = self._promotions.take()
        if promote:
            self._put(messages.promote(promote, self._per_record))
        find = self._finds.take()
        if find:
            self._put(messages.find(self._link.seq, find, self._per_record))
        if self._link.counts_due():
            self._link.report_counts(self._counts(), at_once=False)
        if self.enable_events and self._link.essential:
            self._put([rec.encode_take_events(MAX_EVENTS_PER_ASK)])
        self._link.flush()
        self._link.next_step()

    def has_pending_work(self) -> bool:
        """Records not yet read by the daemon, a reset not yet answered, or a promotion not
        finished (keep the engine stepping until they are)."""
        self._receive()
        if self.available:
            self._link.report_counts(self._counts())     # the daemon's stats catch up
        return bool(self._resets.pending or self._finished) or self._link.unread() or \
            self._promotions.waiting(self._link.acked, self._lookups.find) or \
            self._finds.waiting()

    def _counts(self) -> tuple[int, int, int]:
        """The lookups answered so far (every session of this engine), for the daemon's stats."""
        return (self.lookups_total, self.hits_total, self.misses_total)

    def _receive(self) -> None:
        """Apply what the daemon answered since the last call (of this client generation)."""
        if self._generation == self.client.generation:
            self._link.receive(self._per_record)

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
            if self._link.channel is not None and self.client.available:
                self._put(self._finished)
                self._link.report_counts(self._counts())
                self._link.flush(restart=False)       # its last completions and counts
            self._close_connection()
            self._handoff.close()
