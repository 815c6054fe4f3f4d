"""The daemon's end of the channel (kvd_server/channel/hub.py, service.py) over a real
core, with the engine's end mapped from duplicates of the descriptors an engine receives
(kvd_client/link/channel.py): records apply with the StepStream ops' semantics and answer in order;
a refused record is answered and skipped; an engine that breaks its ring loses its session and
nobody else's state; one that reads no answers is not read; a closing session's last records
still apply."""

from __future__ import annotations

import os
import struct

import pytest

from kvd_client.link.channel import Outbox, SessionChannel
from kvd_proto import records as rec
from kvd_proto.channel import UP_TAIL, ChannelHeader
from kvd_server.channel.hub import ChannelHub
from kvd_server.channel.service import ChannelService
from kvd_server.core.sessions import Session
from tests.support.core import make_core, protocols, session, stats


class Harness:
    def __init__(self) -> None:
        self.core, _ = make_core(pool=8 << 20, extent=1 << 20)
        header = ChannelHeader(64 << 10, 8 << 10)          # small rings: easy to fill
        self.service = ChannelService(self.core, protocols(self.core), header.down_max_record)
        self.broken: list[tuple[Session, str]] = []

        def on_broken(s: object, why: str) -> None:
            assert isinstance(s, Session)
            self.broken.append((s, why))
            self.core.close_session(s, why, reaped=True)

        self.hub = ChannelHub(self.service, on_broken=on_broken,
                              heartbeat=self.core.heartbeat, header=header)
        self.core.on_session_end.append(lambda s: self.hub.close(s.id))

    def engine(self, model: str = "m") -> tuple[Session, SessionChannel, Outbox]:
        s = session(self.core, model=model)
        ch = self.hub.open(s, s.id)
        return s, SessionChannel(os.dup(ch.fd), os.dup(ch.wake_fd)), Outbox()

    def send(self, channel: SessionChannel, outbox: Outbox, *records: bytes,
             seq: int = 0) -> list[rec.DownRecord]:
        for data in records:
            outbox.put(seq, data)
        outbox.flush(channel)
        self.hub.poll()
        return channel.receive()


@pytest.fixture
def h() -> Harness:
    return Harness()


def keys(*ints: int) -> list[bytes]:
    return [bytes([i]) * 8 for i in ints]


def test_reserve_store_complete_and_counters_apply_as_their_stepstream_ops(h):
    s, ch, out = h.engine()
    (granted,) = h.send(ch, out, rec.encode_reserve(4))
    assert isinstance(granted, rec.Granted) and len(granted.offsets) == 4
    assert s.reserve_target == 4 and len(s.granted) == 4
    offs = granted.offsets
    answers = h.send(ch, out, rec.encode_store(keys(1, 2), "r", [0, 1], [0, 1], offs[:2]),
                     rec.encode_complete_store(keys(1, 2), True, "r", 0),
                     rec.encode_counters(10, 7, 3))
    # The two stored slots left the reserve; the daemon topped it up (one GRANTED).
    assert [type(a) for a in answers] == [rec.Granted] and len(answers[0].offsets) == 2
    doc = stats(h.core)
    assert doc["blocks"]["ready"] == 2
    ns = doc["namespaces"][0]
    assert (ns["lookups_total"], ns["hits_total"], ns["misses_total"]) == (10, 7, 3)
    assert h.service.records["store"] == 1 and h.service.rejected_total == 0


def test_a_reserve_run_low_is_replaced_as_each_store_is_read_not_after_the_turn(h):
    """A turn behind a burst reads several steps' stores: once a store takes the reserve
    below half its target it is topped up at once (a GRANTED right after that STORE), so the
    engine gets slots while the rest is read; above half, the turn's one top-up does."""
    s, ch, out = h.engine()
    (granted,) = h.send(ch, out, rec.encode_reserve(4))
    offs = granted.offsets
    answers = h.send(ch, out, rec.encode_store(keys(1), "r", [0], [0], offs[:1]),
                     rec.encode_store(keys(2, 3), "r", [0, 1], [0, 1], offs[1:3]),
                     rec.encode_take_events(16))
    # 4 -> 3 (no top-up yet) -> 1 (below half: topped up to 4 at once, before the answer to
    # the next record), then nothing owed at the turn's end.
    assert [type(a) for a in answers] == [rec.Granted, rec.Events]
    assert len(answers[0].offsets) == 3
    assert len(s.granted) == 4 and not set(offs[:3]) & set(answers[0].offsets)


def test_a_refused_record_is_answered_and_the_next_one_still_applies(h):
    s, ch, out = h.engine()
    ahead = rec.encode_complete_load(keys(1), "r", 99)       # an epoch from the future
    broken = rec.record(rec.TOUCH, b"\xff\xff")              # a field past the end
    answers = h.send(ch, out, ahead, broken, rec.encode_reserve(2))
    assert [type(a) for a in answers] == [rec.Rejected, rec.Rejected, rec.Granted]
    assert answers[0].code == "FAILED_PRECONDITION" and answers[0].kind == rec.COMPLETE_LOAD
    assert answers[1].code == "INVALID_ARGUMENT" and "req_id" in answers[1].message
    assert not h.broken and h.service.rejected_total == 2


def test_a_broken_ring_ends_that_session_only(h):
    s, ch, out = h.engine()
    other, other_ch, other_out = h.engine()
    h.send(other_ch, other_out, rec.encode_reserve(3))
    assert len(other.granted) == 3
    h.send(ch, out, rec.encode_reserve(2))
    struct.pack_into("<Q", ch._map, UP_TAIL, 10**12)        # a tail past the ring
    h.hub.poll()
    assert [b[0] for b in h.broken] == [s] and "channel is broken" in h.broken[0][1]
    assert s.closed and h.hub.get(s.id) is None
    assert not other.closed and len(other.granted) == 3
    assert h.send(other_ch, other_out, rec.encode_reserve(5))[0].offsets
    # Its reserve went back to the pool (its process is gone here: released at once).
    assert stats(h.core)["pool"]["quarantined_slots"] == 0


def test_an_engine_that_reads_no_answers_is_not_read(h):
    s, ch, out = h.engine()
    # Fill the down ring with answers the engine never reads (REJECTED records).
    junk = rec.encode_complete_load(keys(1), "x" * 200, 99)
    for _ in range(250):
        out.put(0, junk)
    out.flush(ch)
    for _ in range(20):
        h.hub.poll()
    unread = ch.writer.tail - ch.read_position
    assert unread > 0, "the daemon kept reading although its answers had no room"
    answers = 0
    for _ in range(100):                                     # the engine reads at last
        answers += len(ch.receive())
        h.hub.poll()
        if ch.writer.tail == ch.read_position and not out.waiting():
            break
        out.flush(ch)
    assert ch.writer.tail == ch.read_position and not out.waiting()
    assert answers + len(ch.receive()) == 250


def test_a_closing_sessions_last_records_still_apply(h):
    s, ch, out = h.engine()
    (granted,) = h.send(ch, out, rec.encode_reserve(1))
    offset = granted.offsets[0]
    out.put(0, rec.encode_store(keys(9), "r", None, [0], [offset]))
    out.put(0, rec.encode_complete_store(keys(9), True, "r", 0))
    out.flush(ch)                                            # written, never polled
    h.core.close_session(s, "closed by client", copies_done=True)
    assert stats(h.core)["blocks"]["ready"] == 1
    assert h.hub.get(s.id) is None and len(h.hub) == 0


def test_the_idle_flag_is_set_only_when_nothing_is_waiting(h):
    s, ch, out = h.engine()
    channel = h.hub.get(s.id)
    assert channel is not None and not ch.view.daemon_idle
    assert channel.go_idle() and ch.view.daemon_idle
    out.put(0, rec.encode_reserve(1))
    out.flush(ch)                           # the engine sees the flag: it writes the eventfd
    assert ch.wakes == 1 and os.eventfd_read(channel.wake_fd) == 1
    channel.view.set_daemon_idle(False)
    out.put(0, rec.encode_reserve(2))
    out.flush(ch)
    assert not channel.go_idle(), "a record is waiting: the daemon must stay awake"


def test_what_the_ring_has_no_room_for_waits_in_order_and_bounds_the_outbox(h, monkeypatch):
    """Records put while the daemon is behind wait, by step, in order; their bytes (counted
    when a flush leaves them waiting) are what `overflowing` compares with its bound."""
    import kvd_client.link.channel as engine_channel

    monkeypatch.setattr(engine_channel, "MAX_WAITING_BYTES", 16 << 10)
    s, ch, out = h.engine()
    counters = rec.encode_counters(1, 1, 0)
    for seq in range(3):                                     # 3 steps of 1,000 records
        out.put_many(seq, [counters] * 1000)
    assert not out.overflowing                               # nothing counted before a flush
    left = out.flush(ch)                                     # the 64 KiB ring takes ~2,000
    assert 0 < left < 3000 and out.overflowing
    assert out._waiting_bytes == left * len(counters)
    for _ in range(200):                                     # the daemon catches up
        h.hub.poll()
        ch.receive()
        if not out.flush(ch) and ch.writer.tail == ch.read_position:
            break
    assert not out.waiting() and not out.overflowing
    ns = stats(h.core)["namespaces"][0]
    assert ns["lookups_total"] == 3000 and ns["hits_total"] == 3000


def test_find_is_answered_when_the_store_answers_and_open_asks_are_bounded(h):
    """FIND: without a tier below, FOUND at once; with one that asks the store, FOUND is
    written outside any turn once it answered (ChannelHub.send); a session with
    MAX_OPEN_FINDS asks unanswered gets FOUND at once for the next (nothing piles up)."""
    from kvd_server.channel.service import MAX_OPEN_FINDS

    s, ch, out = h.engine()
    assert h.send(ch, out, rec.encode_find(3, keys(1, 2))) == [rec.Found(3)]
    waiting: list = []
    h.service.fastpath.find = lambda sess, ks, done: waiting.append(done) or True
    h.service.send = h.hub.send
    assert h.send(ch, out, rec.encode_find(4, keys(3))) == []           # asked: no answer yet
    waiting.pop()()                                                     # the store answered
    assert ch.receive() == [rec.Found(4)]
    for step in range(MAX_OPEN_FINDS):
        h.send(ch, out, rec.encode_find(10 + step, keys(5)))
    assert len(waiting) == MAX_OPEN_FINDS
    assert h.send(ch, out, rec.encode_find(999, keys(6))) == [rec.Found(999)]   # bounded
    for done in waiting:
        done()
    assert len(ch.receive()) == MAX_OPEN_FINDS
