"""What a session's channel records mean to the daemon: the channel's servicer.

`ChannelService` is the `RecordHandler` of kvd_server/channel/hub.py: it decodes one up record
strictly (kvd_proto/records.py), applies it to the core with the same semantics as the
matching StepStream op, and returns the answer record: GRANTED, RESET_DONE, EVENTS, or
REJECTED with a status name and a message for a record that breaks a bound or that the core
refuses (the record is skipped; the session goes on). Nothing raises out of it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from kvd_proto import records as rec
from kvd_proto.wire import DEFAULT_EVENTS, MAX_KEYS_PER_CALL
from kvd_server.core.core import KvdCore
from kvd_server.core.sessions import Session
from kvd_server.errors import KvdError
from kvd_server.manager import OffloadEvent
from kvd_server.protocols.wiring import EngineProtocols

log = logging.getLogger(__name__)

EVENTS_HEADROOM = 64        # an EVENTS record's own fields, beside its events
MAX_OPEN_FINDS = 64         # FIND records of a session the store has not answered yet


class ChannelService:
    """Applies channel records of sessions to the core (see the module doc)."""

    def __init__(self, core: KvdCore, protocols: EngineProtocols, max_answer: int) -> None:
        self.core = core
        self.fastpath = protocols.fastpath
        self.completions = protocols.completions
        self.max_answer = max_answer           # the largest record the down ring takes
        self.records = Counter[str]()          # applied, by kind name
        self.rejected_total = 0
        # Events taken from the namespace that did not fit one answer: the next take_events
        # of that session sends them first (session id -> events).
        self._carry: dict[str, list[OffloadEvent]] = {}
        # Writes an answer into a session's down ring outside a turn (a FOUND once the store
        # answered); set by the daemon to its ChannelHub's `send`.
        self.send: Callable[[str, bytes], bool] = lambda session_id, record: False
        self._open_finds = Counter[str]()      # session id -> FINDs not answered yet

    def __call__(self, session: object, kind: int, payload: bytes) -> bytes | None:
        s = session
        assert isinstance(s, Session)
        if s.closed:
            return None
        try:
            record = rec.decode_up(kind, payload)
            answer = self._apply(s, record)
        except rec.RecordError as exc:
            return self._reject(kind, "INVALID_ARGUMENT", str(exc))
        except KvdError as exc:
            return self._reject(kind, exc.code, exc.message)
        except Exception:  # a bug must not end the daemon or the session
            log.exception("channel record %s of session %s failed", rec.UP_KINDS.get(kind),
                          s.id)
            return self._reject(kind, "INTERNAL", "internal error (see the daemon's log)")
        self.records[rec.UP_KINDS[kind]] += 1
        return answer

    def refill(self, session: object) -> bytes | None:
        """A GRANTED record topping the session's reserve up, when it is short and slots are
        free (the hub asks after every turn that read the session's channel)."""
        s = session
        assert isinstance(s, Session)
        if self.core.retention.prewarming:
            # An engine's turn moved its reclaim epoch: the slots evicted for prewarms may be
            # free now (the sweep's 100 ms would be many engine steps).
            self.core.retention.prewarm_tick()
        fast = self.fastpath
        if s.closed or not fast.owes(s):
            return None
        try:
            granted = fast.top_up_kept(s)
        except Exception:  # a bug must not end the daemon or the session
            log.exception("topping up the reserve of session %s failed", s.id)
            return None
        if not granted.offsets:
            return None
        return rec.encode_granted(*granted)

    def forget(self, session_id: str) -> None:
        self._carry.pop(session_id, None)

    def _reject(self, kind: int, code: str, message: str) -> bytes:
        self.rejected_total += 1
        return rec.encode_rejected(kind, code, message)

    def _apply(self, s: Session, r: rec.UpRecord) -> bytes | None:
        core, fast, done = self.core, self.fastpath, self.completions
        if isinstance(r, rec.Store):
            fast.store_granted(s, r.keys, r.req_id, r.positions, r.granted_keys,
                               r.granted_offsets)
            # Its slots left the reserve. Down to half its target (a turn behind a burst reads
            # several steps' records, and the engine stores meanwhile): topped up now, not
            # after the turn. Otherwise the turn's one top-up does (fewer answers to read).
            if 2 * len(s.granted) < s.reserve_target:
                return self.refill(s)
        elif isinstance(r, rec.CompleteStore):
            done.complete_store(s, r.keys, r.success, r.req_id, r.epoch)
        elif isinstance(r, rec.Pin):
            fast.pin_loads(s, r.keys, r.offsets, r.req_id, r.positions)
        elif isinstance(r, rec.CompleteLoad):
            done.complete_load(s, r.keys, r.req_id, r.epoch)
        elif isinstance(r, rec.Touch):
            core.touch(s, r.keys, r.req_id)
        elif isinstance(r, rec.RequestFinished):
            core.request_finished(s, r.req_id)
        elif isinstance(r, rec.Reserve):
            fast.set_reserve(s, r.target, r.evict, r.kept)
            return self.refill(s)
        elif isinstance(r, rec.Reset):
            answer = core.reset_namespace(s)
            return rec.encode_reset_done(r.token, answer.epoch, answer.dropped)
        elif isinstance(r, rec.TakeEvents):
            return self._events(s, r.max_events or DEFAULT_EVENTS)
        elif isinstance(r, rec.Counters):
            fast.count_lookups(s, r.lookups, r.hits, r.misses)
        elif isinstance(r, rec.ReleaseHeld):
            core.release_held(s, r.session_id)
        elif isinstance(r, rec.ReturnSlots):
            fast.return_slots(s, r.offsets)
        elif isinstance(r, rec.Promote):
            fast.promote(s, r.keys)
        elif isinstance(r, rec.Restore):
            fast.restore(s, r.keys, r.offsets)
        elif isinstance(r, rec.Hint):
            core.retention.hint(s, r.req_id, r.session, r.retain_ms)
        elif isinstance(r, rec.Find):
            return self._find(s, r)
        return None

    def _find(self, s: Session, r: rec.Find) -> bytes | None:
        """Ask the cluster store (FOUND once it answered); answered at once when there is
        nothing to ask, or when the session has MAX_OPEN_FINDS asks unanswered already (an
        engine sends one a step: more means a store slower than many steps, or a hostile
        engine; its keys then read MISS, and nothing piles up)."""
        found = rec.encode_found(r.step)
        if self._open_finds[s.id] >= MAX_OPEN_FINDS:
            return found

        def done() -> None:
            self._open_finds[s.id] -= 1
            if self._open_finds[s.id] <= 0:
                del self._open_finds[s.id]
            self.send(s.id, found)

        if not self.fastpath.find(s, r.keys, done):
            return found                      # nothing to ask: answered at once
        self._open_finds[s.id] += 1
        return None

    def _events(self, s: Session, max_events: int) -> bytes:
        """One EVENTS answer within the down ring's record size: events too big for it are
        split (same flags, the keys in order) and the rest carried to the next answer. It
        says how many events the namespace dropped unseen since its previous answer."""
        budget = self.max_answer - EVENTS_HEADROOM
        queue = self._carry.pop(s.id, [])
        dropped = 0
        if len(queue) < max_events:
            taken, _, dropped = self.core.take_events(s, max_events - len(queue), budget)
            queue.extend(taken)
        out: list[tuple[tuple[bytes, ...], bool, bool]] = []
        while queue and len(out) < max_events:
            event = queue[0]
            keys = event.keys
            fit = 0
            cost = rec.events_bytes(())
            for key in keys[:MAX_KEYS_PER_CALL]:
                if cost + len(key) + 1 > budget:
                    break
                cost += len(key) + 1
                fit += 1
            if not fit:
                break
            out.append((keys[:fit], event.removed, event.metadata_only))
            budget -= cost
            if fit < len(keys):
                queue[0] = OffloadEvent(keys[fit:], event.removed, event.metadata_only)
                break
            queue.pop(0)
        more = bool(queue) or bool(self.core.namespace_of(s).mgr.pending_events())
        if queue:
            self._carry[s.id] = queue
        return rec.encode_events(out, more, dropped)
