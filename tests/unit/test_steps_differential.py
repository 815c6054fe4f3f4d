"""The scheduler's compiled steps (kvd_proto/_steps.c: Lookups.store / pin / complete /
settle) against their one Python twin, the session's own path (kvd_client/offload/
transfers.py, stores.py, loads.py): two engine sessions over one real shared index, one on
the compiled Lookups and one on `PyLookups` (which has no steps: its session runs the Python
path only), are driven through the same random sequence of lookups, stores into granted
slots, loads of HITs, completions (succeeded and failed), settling (the daemon having read the
records), resets, request ends and daemon answers. After every step they must have answered
alike, hold their trackers' containers alike and have written the same records, byte for
byte, for the daemon. A fake daemon in the test reads both channels (asserting them equal)
and applies what it reads to the index once, as the real one would for either.

One difference is known and kept out of the sequences: a key answered HIT at two offsets in
one step (its block moved to another slot between two lookups, or the engine's own completed
store answered before another engine's copy showed READY). The compiled pin finds a key in
this step's HIT log from where the last pin ended (kvd_proto/_native.c, `lookups_hit_find`),
so it may load the earlier offset where the twin (a dict: the later HIT replaces the earlier)
loads the later. Both slots are safe to read until the step's epoch is left behind; only the
slot the PIN record names differs. So no key HIT this step moves here (`moves_now`).
"""

from __future__ import annotations

import mmap
import os
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvd_client.link.channel import SessionChannel
from kvd_client.link.connection import Connection
from kvd_client.link.index_reader import STATE_FREE, STATE_READY, IndexReader, Marks
from kvd_client.offload import daemon_link
from kvd_client.offload import session as session_module
from kvd_client.offload.session import Lookup, OffloadSession
from kvd_proto import records as rec
from kvd_proto.channel import ChannelHeader, ChannelView
from kvd_proto.index_layout import MARKS_BYTES, slot_offset
from kvd_proto.native import PyLookups
from kvd_server.memory.shm_index import ShmIndex

try:
    from kvd_proto import _native
except ImportError:                      # no compiler at install: nothing to compare
    _native = None

pytestmark = pytest.mark.skipif(
    _native is None, reason="kvd_proto._native was not built (no C compiler or Python headers "
    "at install): there are no compiled steps to hold equal to their Python twin")

CAPACITY, WIDTH, PER_EXTENT, STRIDE = 64, 128, 16, 4096
EXTENT = PER_EXTENT * STRIDE + 8192
UP_BYTES = DOWN_BYTES = 8192         # 6 keys a record at this width: calls that do not fit too
KEYS = [bytes([i]) * (4 + i % 5) for i in range(1, 13)]
REQS = ["r1", "r2", "r3"]
INITIAL_SLOTS = 6


def offset_of(slot: int) -> int:
    return slot_offset(slot, PER_EXTENT, EXTENT, STRIDE)


SLOT_OF = {offset_of(slot): slot for slot in range(CAPACITY)}


class Engine:
    """One engine's OffloadSession over the shared index (Lookups of `kind`), connected as
    the real connection would leave it, and the daemon's end of its channel."""

    def __init__(self, kind: type, index: ShmIndex, offsets: list[int]) -> None:
        self.client = SimpleNamespace(available=False, generation=1, previous_session_id=None,
                                      pool_id="pool", on_reconnect=None,
                                      drop_session=self._dropped)
        with mock.patch.object(session_module, "Lookups", kind):
            self.session = OffloadSession(self.client)  # type: ignore[arg-type]
        header = ChannelHeader(UP_BYTES, DOWN_BYTES)
        fd = os.memfd_create("kvd-test-channel", os.MFD_CLOEXEC)
        os.ftruncate(fd, header.file_bytes)
        os.pwrite(fd, header.pack(), 0)
        self._map = mmap.mmap(fd, header.file_bytes)
        self._buf = memoryview(self._map)
        self.daemon = ChannelView(self._buf, header, engine=False)
        channel = SessionChannel(fd, os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
        marks = os.memfd_create("kvd-test-marks", os.MFD_CLOEXEC)
        os.ftruncate(marks, MARKS_BYTES)
        self.session._handoff.put(Connection(1, IndexReader(os.dup(index.fd)), Marks(marks),
                                             channel, list(offsets)))
        self.client.available = True

    def _dropped(self, reason: str) -> None:
        raise AssertionError(f"the session was dropped: {reason}")

    def read(self) -> list[tuple[int, bytes]]:
        """What the daemon reads of the engine's channel now (and lets it know it read)."""
        reader = self.daemon.reader
        records = reader.read_all()
        reader.commit()
        return records

    def answer(self, record: bytes) -> None:
        assert self.daemon.writer.write(record), "the down ring is full"
        self.daemon.writer.publish()

    def close(self) -> list[tuple[int, bytes]]:
        self.session.close()
        last = self.read()
        self.daemon.release()
        self._buf.release()
        self._map.close()
        return last


def state(s: OffloadSession) -> dict[str, Any]:
    """Everything the session's steps keep: the trackers' containers, the reserve, the
    link's records and what waits in its outbox, the lookups' counts."""
    stores, loads, reserve, link, lookups = s._stores, s._loads, s._reserve, s._link, s._lookups
    return {
        "stores": dict(stores.stores),
        "completed": list(stores.completed),
        "settling": [entry[:3] for entry in stores._settling],   # the C keeps hashes too
        "failed": (dict(stores.failed), list(stores._failing)),
        "stale": ({e: list(k) for e, k in stores._stale.items()}, list(stores._deferred)),
        "pins": {req: [(p.epochs, p.keys, p.left, p.done) for p in pins]
                 for req, pins in loads._pins.items()},
        "loads": (dict(loads._epochs), dict(loads._stale_epochs),
                  {e: list(k) for e, k in loads._stale_loads.items()}),
        "reserve": (list(reserve.slots), reserve.target, reserve.sent, reserve.declined,
                    reserve.urgent, reserve._step_demand, reserve._unreplaced),
        "kept": (sorted(reserve.kept.items()), list(reserve._restoring), list(s._restores)),
        "resets": (s._resets.pending, s._resets.epoch),
        "link": (list(link.records), link._optional, link.seq, link.acked,
                 link._staged_essential, link.outbox.sent, list(link.outbox._written),
                 [(w.seq, list(w.records), w.essential) for w in link.outbox._waiting]),
        "lookups": (lookups.lookups, lookups.hits, lookups.misses, lookups.enabled),
        "step": (s._in_step, s._step_epoch, list(s._finished), s._marks and s._marks.published),
    }


class TwoEngines(RuleBasedStateMachine):
    """The compiled engine (`c`) and the twin (`py`) side by side, and the fake daemon."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = [1000.0]
        self._time = mock.patch.object(daemon_link, "time",
                                       SimpleNamespace(monotonic=lambda: self.clock[0]))
        self._time.start()
        self.index = ShmIndex(CAPACITY, WIDTH, PER_EXTENT, STRIDE, EXTENT, name="kvd-diff")
        self.free = list(range(CAPACITY))
        granted = self._take(INITIAL_SLOTS)
        self.c = Engine(_native.Lookups, self.index, granted)
        self.py = Engine(PyLookups, self.index, granted)
        assert self.c.session._steps is not None and self.py.session._steps is None
        self.storing: dict[int, bytes] = {}      # slot -> key the daemon published storing
        self.kept: dict[int, bytes] = {}         # free slot -> the block evicted from it
        self.granted_kept: dict[int, bytes] = {}  # granted slot -> the block GRANTED named
        self.calls: list[list[bytes]] = []       # recent store calls' new keys

    def _take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return [offset_of(slot) for slot in taken]

    def _taken_kept(self, offsets: list[int]) -> tuple[list[int], list[bytes]]:
        """Which of the slots just taken still hold an evicted block (GRANTED's trailer)."""
        index, keys = [], []
        for i, offset in enumerate(offsets):
            key = self.kept.pop(SLOT_OF[offset], None)
            if key is not None and self.index.find(key) < 0:
                index.append(i)
                keys.append(key)
        return index, keys

    def moves_now(self, key: bytes) -> bool:
        """Whether a change of `key`'s slot now would make it a HIT at two offsets in this
        step (see the module doc); the twin's HITs are a plain dict, asked without effect."""
        return self.py.session.hit_offset(key) is not None

    def both(self, call: str, *args: Any) -> Any:
        """`call` on both sessions with the same arguments; their answers must be equal."""
        got = [getattr(e.session, call)(*args) for e in (self.c, self.py)]
        assert got[0] == got[1], (call, args, got)
        return got[0]

    @initialize(ready=st.sets(st.sampled_from(KEYS), max_size=len(KEYS) // 2))
    def stored_before(self, ready: set[bytes]) -> None:
        """Blocks other engines stored before these two started."""
        for key in sorted(ready):
            slot = self.free.pop()
            self.index.insert(slot, key)
            self.index.set_ready(slot)

    # ----------------------------------------------------------------- the engine's calls
    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=6))
    def lookup(self, keys: list[bytes]) -> None:
        for key in keys:
            self.both("lookup", key)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=8, unique=True),
          req=st.sampled_from(REQS), positions=st.booleans())
    def scheduler_step(self, keys: list[bytes], req: str, positions: bool) -> None:
        """What vLLM's scheduler does with a request: look its keys up, load the HITs,
        store the misses (the common calls, which the compiled steps take)."""
        answers = [self.both("lookup", key) for key in keys]
        hits = [k for k, a in zip(keys, answers, strict=True) if a is Lookup.HIT]
        if hits:
            self.both("start_loads", hits, req, _positions("range" if positions else "none",
                                                           len(hits)))
        misses = [k for k, a in zip(keys, answers, strict=True) if a is Lookup.MISS]
        if misses:
            self.store(misses, req, "range" if positions else "none")

    @rule(data=st.data(), req=st.sampled_from(REQS))
    def finish_a_pin(self, data: st.DataObject, req: str) -> None:
        """vLLM's finish: a pin's keys, as a set, with its request."""
        pins = self.c.session._loads._pins.get(req)
        if pins:
            self.both("finish_loads", set(data.draw(st.sampled_from(pins)).keys), req)

    @rule(data=st.data(), req=st.sampled_from(REQS), success=st.integers(0, 4))
    def complete_a_call(self, data: st.DataObject, req: str, success: int) -> None:
        """vLLM's completion: one store call's keys, as a set (failed now and then)."""
        if self.calls:
            self.both("complete_store", set(data.draw(st.sampled_from(self.calls))), req,
                      success > 0)

    @rule(data=st.data(), req=st.sampled_from(REQS), extra=st.booleans(),
          positions=st.sampled_from(["none", "range", "short"]))
    def start_loads(self, data: st.DataObject, req: str, extra: bool, positions: str) -> None:
        hits = [k for k in KEYS if self.c.session.hit_offset(k) is not None]
        pool = hits + KEYS if extra or not hits else hits
        keys = data.draw(st.lists(st.sampled_from(pool), max_size=8))
        self.both("start_loads", keys, req, _positions(positions, len(keys)))

    @rule(data=st.data(), req=st.sampled_from([*REQS, ""]),
          how=st.sampled_from(["set", "list", "shuffled", "part", "more"]))
    def finish_loads(self, data: st.DataObject, req: str, how: str) -> None:
        pins = [p.keys for ps in self.c.session._loads._pins.values() for p in ps]
        keys: Any = sorted(data.draw(st.sampled_from(pins))) if pins else []
        if how == "set":
            keys = set(keys)
        elif how == "shuffled":
            keys = data.draw(st.permutations(keys))
        elif how == "part":
            keys = keys[:data.draw(st.integers(0, len(keys)))]
        elif how == "more":
            keys = keys + data.draw(st.lists(st.sampled_from(KEYS), max_size=2))
        self.both("finish_loads", keys, req)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=8), req=st.sampled_from(REQS),
          positions=st.sampled_from(["none", "range", "short"]))
    def store(self, keys: list[bytes], req: str, positions: str) -> None:
        got = self.both("store_slots", keys, req, _positions(positions, len(keys)))
        if got is not None and got[0]:
            self.calls = [*self.calls[-3:], list(got[0])]

    @rule(data=st.data(), req=st.sampled_from(REQS), success=st.booleans(),
          how=st.sampled_from(["call", "call-set", "call-shuffled", "any", "any-set"]))
    def complete_store(self, data: st.DataObject, req: str, success: bool, how: str) -> None:
        if how.startswith("call") and self.calls:
            keys: Any = list(data.draw(st.sampled_from(self.calls)))
            if how == "call-shuffled":
                keys = data.draw(st.permutations(keys))
        else:
            in_flight = sorted(self.c.session._stores.stores) or KEYS
            keys = data.draw(st.lists(st.sampled_from(in_flight + KEYS[:2]), max_size=7))
        if how.endswith("set"):
            keys = set(keys)
        self.both("complete_store", keys, req, success)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=8))
    def new_keys(self, keys: list[bytes]) -> None:
        self.both("new_keys", keys)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=8),
          req=st.sampled_from(REQS))
    def touch(self, keys: list[bytes], req: str) -> None:
        self.both("touch", keys, req)

    @rule(req=st.sampled_from(REQS))
    def request_finished(self, req: str) -> None:
        self.both("request_finished", req)

    @rule()
    def end_step(self) -> None:
        hits = [e.session._lookups.recorded() for e in (self.c, self.py)]
        assert hits[0] == hits[1], "this step's HITs differ"
        self.both("end_step")

    @rule()
    def has_pending_work(self) -> None:
        self.both("has_pending_work")

    @rule(now=st.integers(0, 5))
    def reset(self, now: int) -> None:
        if not now:                   # now and then: a reset turns everything in flight stale
            self.both("reset")

    @rule()
    def reset_flushed(self) -> None:
        self.both("reset_flushed")

    @rule()
    def tick(self) -> None:
        self.clock[0] += daemon_link.COUNTS_INTERVAL_S

    # ----------------------------------------------------------------- the daemon
    @rule()
    def daemon_reads(self) -> None:
        """The daemon reads both channels (the same records, byte for byte) and applies
        them to the index once: stores published storing, completions ready or gone, a
        reset done and answered."""
        records = self.c.read()
        assert records == self.py.read(), "the engines wrote different records"
        for kind, payload in records:
            self._apply(kind, payload)

    def _apply(self, kind: int, payload: bytes) -> None:
        index = self.index
        up = rec.decode_up(kind, payload)
        if isinstance(up, rec.Store):
            for key, offset in zip(up.granted_keys, up.granted_offsets, strict=True):
                slot = SLOT_OF[offset]
                self.granted_kept.pop(slot, None)
                if index.find(key) < 0 and index.state(slot) == STATE_FREE:
                    index.insert(slot, key)
                    self.storing[slot] = key
        elif isinstance(up, rec.CompleteStore) and up.epoch == index.reset_epoch:
            for key in up.keys:
                slot = index.find(key)
                if self.storing.get(slot) == key:
                    del self.storing[slot]
                    if up.success:
                        index.set_ready(slot)
                    else:
                        index.remove(slot)
                        self.free.append(slot)
        elif isinstance(up, rec.Reset):
            dropped = sum(index.state(slot) != STATE_FREE for slot in range(CAPACITY))
            index.clear()
            self.kept.clear()
            self.granted_kept.clear()
            self.free.extend(self.storing)  # (the real daemon keeps them until copies end)
            self.storing.clear()
            index.reset_epoch += 1
            done = rec.encode_reset_done(up.token, index.reset_epoch, dropped)
            for engine in (self.c, self.py):
                engine.answer(done)
        elif isinstance(up, rec.ReturnSlots):
            self.free.extend(SLOT_OF[offset] for offset in up.offsets)
            for offset in up.offsets:
                self.granted_kept.pop(SLOT_OF[offset], None)
        elif isinstance(up, rec.Restore):
            for key, offset in zip(up.keys, up.offsets, strict=True):
                slot = SLOT_OF[offset]
                if self.granted_kept.pop(slot, None) == key and index.find(key) < 0:
                    index.insert(slot, key)
                    index.set_ready(slot)
                else:
                    self.free.append(slot)

    @rule(n=st.integers(1, 6))
    def grant(self, n: int) -> None:
        offsets = self._take(n)
        if offsets:
            index, keys = self._taken_kept(offsets)
            self.granted_kept.update((SLOT_OF[offsets[i]], k) for i, k in zip(index, keys))
            for engine in (self.c, self.py):
                engine.answer(rec.encode_granted(offsets, index, keys))

    @rule(key=st.sampled_from(KEYS), ready=st.booleans())
    def another_engine_stores(self, key: bytes, ready: bool) -> None:
        if self.free and self.index.find(key) < 0 and not self.moves_now(key):
            slot = self.free.pop()
            self.kept.pop(slot, None)
            self.index.insert(slot, key)
            if ready:
                self.index.set_ready(slot)

    @precondition(lambda self: bool(self.storing))
    @rule(data=st.data(), success=st.booleans())
    def another_copy_settles(self, data: st.DataObject, success: bool) -> None:
        """A store the daemon published finishes without this engine's completion (another
        engine's copy of the same block won, or the daemon failed it)."""
        slot = data.draw(st.sampled_from(sorted(self.storing)))
        del self.storing[slot]
        if success:
            self.index.set_ready(slot)
        else:
            self.index.remove(slot)
            self.free.append(slot)

    @rule(key=st.sampled_from(KEYS))
    def evict(self, key: bytes) -> None:
        slot = self.index.find(key)
        if slot >= 0 and slot not in self.storing and not self.moves_now(key):
            self.index.remove(slot)
            self.free.insert(0, slot)          # granted next, as the daemon's freed slots are
            self.kept[slot] = key              # intact until the slot is taken

    @rule(key=st.sampled_from(KEYS))
    def evict_into_reserve(self, key: bytes) -> None:
        """The daemon evicts a block and grants its slot to both engines' reserves, naming
        the block it still holds; their next step looks it up (HIT_PENDING: taken back from
        the reserve, RESTORE sent) and the daemon reads that (the block READY again)."""
        slot = self.index.find(key)
        if slot >= 0 and self.index.state(slot) == STATE_READY and slot not in self.storing \
                and not self.moves_now(key):
            self.evict(key)
            self.grant(1)
            self.end_step()
            self.lookup([key])
            self.end_step()
            self.daemon_reads()

    @rule()
    def reclaim(self) -> None:
        self.index.reclaim_epoch += 1

    # ----------------------------------------------------------------- after every step
    @invariant()
    def alike(self) -> None:
        c, py = state(self.c.session), state(self.py.session)
        for part in c:
            assert c[part] == py[part], (part, c[part], py[part])

    def teardown(self) -> None:
        try:
            last = [e.close() for e in (self.c, self.py)]
            assert last[0] == last[1], "the engines' last records differ"
        finally:
            self.index.close()
            self._time.stop()


def _positions(how: str, n: int) -> Any:
    if how == "range":
        return range(16, 16 * (n + 1), 16)
    if how == "short":
        return list(range(max(0, n - 1)))
    return None


TwoEngines.TestCase.settings = settings(max_examples=150, stateful_step_count=50,
                                        deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
test_the_compiled_steps_and_their_python_twin_do_alike = TwoEngines.TestCase


def test_a_request_id_no_record_carries_is_left_out_alone():
    """A request's REQUEST_FINISHED is encoded when the engine says it ended: an id no record
    can carry (over 65,535 bytes, a lone surrogate) is logged and left out, never raised into
    the engine's scheduler; the other requests' ends still go out with the step's records."""
    index = ShmIndex(CAPACITY, WIDTH, PER_EXTENT, STRIDE, EXTENT, name="kvd-finished")
    engine = Engine(_native.Lookups, index, [offset_of(slot) for slot in range(INITIAL_SLOTS)])
    try:
        session = engine.session
        session.lookup(KEYS[0])                  # the step begins (the connection adopted)
        session.request_finished("x" * 70000)
        session.request_finished("\ud800")
        session.request_finished("ok")
        session.end_step()
        ends = [rec.decode_up(kind, payload) for kind, payload in engine.read()
                if kind == rec.REQUEST_FINISHED]
        assert ends == [rec.RequestFinished("ok")]
        assert session._id_log.total == 2
    finally:
        engine.close()
        index.close()
