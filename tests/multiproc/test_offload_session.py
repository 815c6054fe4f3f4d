"""The fast path between real processes: OffloadSessions (in this process and in engine
processes) over a real `kvd serve`, its shared index and its pool.

What an engine relies on: a block one engine stored is a HIT in another process's very first
step and loads byte for byte; two engines storing the same keys settle on one block per key;
grants cannot be forged or replayed; garbage in a session's own marks file neither leaks slots
nor lets a slot still being read go to a new store; a dead daemon costs the scheduler thread
no call (lookups MISS, stores are declined at once).
"""

from __future__ import annotations

import mmap
import os
import signal
import struct

import pytest

from kvd_client.client import KvdClient
from kvd_client.offload.session import Lookup
from kvd_proto import kvd_pb2
from tests.support.engine import BLOCK, block_bytes_of, keys_for
from tests.support.offload_engine import (
    LAYOUT,
    EngineProcess,
    assert_no_slot_leaked,
    close_session,
    count_blocking_calls,
    load,
    namespace,
    open_session,
    read_block,
    settle,
    store,
    wait_idle,
    write_block,
)
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc
MODEL = "fast-path-model"
SMALL_POOL = ("--pool-size", "8MiB", "--extent-size", "2MiB")     # 128 slots of 64 KiB


def test_a_block_stored_here_is_a_hit_in_another_process_and_loads_byte_for_byte(daemon):
    a = open_session(daemon.socket, MODEL, reserve=64)
    calls = count_blocking_calls(a.client)
    b: EngineProcess | None = None
    keys = keys_for("cross-process", 48)
    try:
        granted = store(a, keys)
        assert granted is not None and [k for k, _ in granted] == keys
        assert len({offset for _, offset in granted}) == len(keys), "one slot granted twice"
        doc = daemon.stats()
        assert doc["blocks"]["ready"] == len(keys) and doc["blocks"]["storing"] == 0

        b = EngineProcess(daemon.socket, MODEL)
        out = b.ask("load", keys)                     # its first step
        assert out["states"] == ["hit"] * len(keys), out["states"]
        assert out["bad"] == [], f"{len(out['bad'])} blocks loaded with another key's bytes"
        b.ask("settle")
        states, bad = load(a, keys)                   # and the writer reads them too
        assert states == [Lookup.HIT] * len(keys) and bad == []
        assert a.lookup(b"never-stored") is Lookup.MISS
        settle(a)
        assert daemon.stats()["blocks"]["pinned"] == 0
        assert calls[0] == 0, f"{calls[0]} calls to the daemon on the scheduler thread"
    finally:
        if b is not None:
            b.close()
        close_session(a)
    doc = wait_idle(daemon)
    assert doc["blocks"]["ready"] == len(keys)
    assert_no_slot_leaked(daemon, MODEL)


@pytest.mark.parametrize("writer_native", [True, False], ids=["compiled-writes", "twins-write"])
def test_the_compiled_calls_and_their_python_twins_work_together(daemon, writer_native):
    """An engine on the scheduler's compiled store / pin / complete / settle paths
    (kvd_proto/_steps.c, the rings' passes) and one on their Python twins (KVD_NATIVE=0 in its
    process) share a daemon: each loads byte for byte what the other stored, a second offer of
    stored keys takes no slot, and every store completes, settles and leaks nothing."""
    ours, theirs = keys_for(f"twins-{writer_native}", 40), keys_for(f"back-{writer_native}", 24)
    w = EngineProcess(daemon.socket, MODEL, reserve=64, native=writer_native)
    r = EngineProcess(daemon.socket, MODEL, reserve=64, native=not writer_native)
    try:
        if _native_built():
            assert w.ask("native")["native"] is writer_native
            assert r.ask("native")["native"] is not writer_native
        assert [bytes.fromhex(k) for k, _ in w.ask("store", ours)["granted"]] == ours
        out = r.ask("load", ours)
        assert out["states"] == ["hit"] * len(ours) and out["bad"] == []
        assert len(r.ask("store", theirs)["granted"]) == len(theirs)
        assert w.ask("store", ours)["granted"] == []          # stored already: nothing new
        out = w.ask("load", theirs + ours)
        assert out["states"] == ["hit"] * len(theirs + ours) and out["bad"] == []
        w.ask("settle")
        r.ask("settle")
        assert w.ask("counts")["hits"] == len(theirs + ours)
        assert r.ask("counts")["hits"] == len(ours)
    finally:
        w.close()
        r.close()
    doc = wait_idle(daemon)
    assert doc["blocks"]["ready"] == len(ours) + len(theirs)
    assert_no_slot_leaked(daemon, MODEL)


def _native_built() -> bool:
    try:
        import kvd_proto._native  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("KVD_NATIVE") != "0"


@pytest.mark.parametrize("order", ["first-offered-completes-first", "duplicate-completes-first"])
def test_two_engines_storing_the_same_keys_settle_on_one_block_each(daemon, order):
    keys = keys_for(f"duplicate-{order}", 24)
    a = open_session(daemon.socket, MODEL, reserve=64)
    b = EngineProcess(daemon.socket, MODEL, reserve=64)
    try:
        # Both engines decide to store every key before the daemon has heard of either.
        b_granted = b.ask("reserve", keys)["granted"]
        assert b_granted is not None and len(b_granted) == len(keys)
        a_granted = store(a, keys, wait=False) if order.startswith("first") else None
        if a_granted is None:
            # a's stores reach the daemon first but stay unfinished; b's duplicates complete
            # first and win; a's completion comes last and loses its slots.
            a_granted = a.reserve(keys)
            assert a_granted is not None and len(a_granted) == len(keys)
            for key, offset in a_granted:
                write_block(a, offset, key)
            settle(a)
            b.ask("complete")
            b.ask("settle")
            a.complete_store(keys)
            settle(a)
        else:
            settle(a)
            b.ask("complete")
            b.ask("settle")
        assert len(a_granted) == len(keys)
        assert not {o for _, o in a_granted} & {o for _, o in b_granted}, "one slot granted twice"

        doc = daemon.stats()
        ns = namespace(doc, MODEL)
        assert doc["blocks"]["total"] == len(keys), doc["blocks"]
        assert doc["blocks"]["ready"] == len(keys) and doc["blocks"]["storing"] == 0
        assert ns["stores_completed_total"] == len(keys)
        # The first completed store of each key won: its block sits in that store's slot.
        winner = a_granted if order.startswith("first") else [(k, o) for k, o in b_granted]
        assert [a.lookup(k) for k in keys] == [Lookup.HIT] * len(keys)
        assert [a.hit_offset(k) for k in keys] == [o for _, o in winner]
        a.end_step()
        out = b.ask("load", keys)
        assert out["states"] == ["hit"] * len(keys) and out["bad"] == []
        states, bad = load(a, keys)
        assert states == [Lookup.HIT] * len(keys) and bad == []
        settle(a)
    finally:
        b.close()
        close_session(a)
    doc = wait_idle(daemon)
    assert doc["blocks"]["total"] == len(keys)
    assert_no_slot_leaked(daemon, MODEL)


def _raw_client(daemon) -> KvdClient:
    client = KvdClient(daemon.socket, model=MODEL, layout=LAYOUT, deadline_s=2.0,
                       engine_id=f"raw-{os.getpid()}")
    assert client.wait_available(10)
    return client


def _step(client: KvdClient, op: kvd_pb2.StepOp) -> kvd_pb2.StepResult:
    results = client.step([op])
    assert results is not None, "the daemon refused a whole step"
    return results[0]


def _grant(client: KvdClient, n: int) -> list[int]:
    offsets = list(_step(client, kvd_pb2.StepOp(grant=kvd_pb2.GrantRequest(count=n)))
                   .grant.slot_offsets)
    assert len(offsets) == n
    return offsets


def _store_granted(client: KvdClient, keys: list[bytes], granted: list[tuple[bytes, int]]
                   ) -> kvd_pb2.StoreGrantedResponse:
    return _step(client, kvd_pb2.StepOp(store_granted=kvd_pb2.StoreGrantedRequest(
        keys=keys, req_id="f", granted_keys=[k for k, _ in granted],
        granted_offsets=[o for _, o in granted]))).store_granted


def _write(client: KvdClient, offset: int, key: bytes) -> None:
    assert client.pool is not None
    view = client.pool.view(offset, BLOCK)
    view[:] = block_bytes_of(key)
    view.release()


def _complete(client: KvdClient, keys: list[bytes], epoch: int) -> int:
    return _step(client, kvd_pb2.StepOp(complete_store=kvd_pb2.CompleteStoreRequest(
        keys=keys, success=True, req_id="f", epoch=epoch))).complete_store.completed


def test_forged_and_replayed_grants_are_refused_and_leak_nothing(daemon):
    x, y = _raw_client(daemon), _raw_client(daemon)
    k = keys_for("forged", 10)
    try:
        gx, gy = _grant(x, 4), _grant(y, 2)
        stride = namespace(daemon.stats(), MODEL)["slot_bytes"]
        unused = max(gx + gy) + stride            # a slot nobody was granted
        for forged in (gy[0], unused, gx[0] + 4096, daemon.stats()["pool"]["total_bytes"]):
            answer = _store_granted(x, [k[0]], [(k[0], forged)])
            assert (answer.accepted, answer.refused) == (0, 1), f"offset {forged} was taken"
        # A granted slot for a key the call does not offer: refused.
        answer = _store_granted(x, [k[1]], [(k[9], gx[0])])
        assert (answer.accepted, answer.refused) == (0, 1)
        # Used once; the same grant replayed, or for another key: refused.
        answer = _store_granted(x, [k[1]], [(k[1], gx[0])])
        assert (answer.accepted, answer.refused) == (1, 0)
        epoch = answer.epoch
        answer = _store_granted(x, [k[1]], [(k[1], gx[0])])
        assert (answer.accepted, answer.refused) == (0, 1), "a replayed grant was taken"
        answer = _store_granted(x, [k[2]], [(k[2], gx[0])])
        assert (answer.accepted, answer.refused) == (0, 1), "a used grant was taken again"
        # One slot named twice in one call: one key gets it, the other is refused.
        answer = _store_granted(x, [k[3], k[4]], [(k[3], gx[1]), (k[4], gx[1])])
        assert (answer.accepted, answer.refused) == (1, 1), "two keys bound to one slot"
        _write(x, gx[0], k[1])
        _write(x, gx[1], k[3])
        assert _complete(x, [k[1], k[3]], epoch) == 2
        # A completion of a key x never stored in its slots changes nothing.
        assert _complete(x, [k[0], k[4]], epoch) == 0
        # y's grants were untouched by x's forgeries: its store goes through.
        answer = _store_granted(y, [k[5]], [(k[5], gy[0])])
        assert (answer.accepted, answer.refused) == (1, 0)
        _write(y, gy[0], k[5])
        assert _complete(y, [k[5]], answer.epoch) == 1

        doc = daemon.stats()
        assert doc["blocks"]["total"] == 3 and doc["blocks"]["ready"] == 3, doc["blocks"]
        states = _step(x, kvd_pb2.StepOp(lookup=kvd_pb2.LookupRequest(keys=k))).lookup.states
        hits = [key for key, s in zip(k, states) if s == kvd_pb2.BLOCK_STATE_HIT]
        assert hits == [k[1], k[3], k[5]], [k.index(h) for h in hits]
        loaded = _step(y, kvd_pb2.StepOp(prepare_load=kvd_pb2.PrepareLoadRequest(
            keys=hits, req_id="f"))).prepare_load
        assert y.pool is not None
        for key, offset in zip(hits, loaded.slot_offsets):
            assert read_block(y.pool, offset) == block_bytes_of(key), f"{k.index(key)} is torn"
        _step(y, kvd_pb2.StepOp(complete_load=kvd_pb2.CompleteLoadRequest(
            keys=hits, req_id="f", epoch=loaded.epoch)))
    finally:
        x.close()
        y.close()
    doc = wait_idle(daemon)
    assert doc["blocks"]["total"] == 3
    assert_no_slot_leaked(daemon, MODEL)


class GarbageMarks:
    """A client that maps its own marks file and writes whatever it likes into it."""

    def __init__(self, daemon) -> None:
        self.client = _raw_client(daemon)
        mapped = self.client.map_index()
        assert mapped is not None, "no shared index"
        os.close(mapped[0])
        self._fd = mapped[1]
        self._map = mmap.mmap(self._fd, 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def write(self, value: int) -> None:
        struct.pack_into("<Q", self._map, 0, value)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
        self.client.close()


def _churn(session, seed: str, n: int, forbidden: set[int], stall_s: float = 1.0
           ) -> tuple[int, set[int]]:
    """Store up to `n` new keys in batches of 16 until the reserve stays short (a reader holds
    freed slots back); (keys stored, offsets granted). No granted offset may be `forbidden`."""
    stored = 0
    seen: set[int] = set()
    keys = keys_for(seed, n)
    for i in range(0, n, 16):
        granted = store(session, keys[i:i + 16], stall_s=stall_s)
        if granted is None:
            break
        offsets = {o for _, o in granted}
        assert not offsets & forbidden, "a slot another engine still reads went to a new store"
        seen |= offsets
        stored += len(granted)
    return stored, seen


@pytest.mark.parametrize("pin", ["epoch-only", "pin-at-daemon"])
@pytest.mark.parametrize("garbage", [2**64 - 1, 1], ids=["max", "one"])
def test_garbage_in_a_sessions_marks_cannot_reuse_a_slot_being_read_or_leak(start_daemon,
                                                                          garbage, pin):
    daemon = start_daemon(*SMALL_POOL)
    a = open_session(daemon.socket, MODEL, reserve=16)
    reader = EngineProcess(daemon.socket, MODEL)
    liar: GarbageMarks | None = None
    ready = keys_for("marks-ready", 8)
    reading = ready[:4]
    try:
        assert store(a, ready) is not None
        # The reader looks the blocks up and starts loading them: it pinned them in its step;
        # the daemon hears of the pins at the end of the step, or (epoch-only) not yet, and
        # then only the reader's published epoch protects the slots.
        assert reader.ask("lookup", reading)["states"] == ["hit"] * 4
        offsets = set(reader.ask("pin", reading)["offsets"])
        if pin == "pin-at-daemon":
            reader.ask("end_step")
            reader.ask("settle")
        liar = GarbageMarks(daemon)
        liar.write(garbage)
        # Nor can the liar release the reader's pins or complete the writer's blocks.
        epoch = namespace(daemon.stats(), MODEL)["epoch"]
        _step(liar.client, kvd_pb2.StepOp(complete_load=kvd_pb2.CompleteLoadRequest(
            keys=reading, epoch=epoch)))
        assert _step(liar.client, kvd_pb2.StepOp(complete_store=kvd_pb2.CompleteStoreRequest(
            keys=ready, success=False, epoch=epoch))).complete_store.completed == 0
        doc = daemon.stats()
        assert doc["blocks"]["pinned"] == (4 if pin == "pin-at-daemon" else 0), doc["blocks"]
        assert doc["blocks"]["ready"] + doc["blocks"]["pinned"] == len(ready)

        evictions = namespace(daemon.stats(), MODEL)["evictions_total"]
        _churn(a, "marks-churn", 512, offsets)
        assert namespace(daemon.stats(), MODEL)["evictions_total"] > evictions, "no eviction"
        states = [a.lookup(k) for k in reading]
        a.end_step()
        # Evicted (their slots freed, held back for the reader), or pinned and kept.
        assert states == [Lookup.MISS if pin == "epoch-only" else Lookup.HIT] * 4, states
        assert reader.ask("read", reading)["match"] == [True] * 4, "read another key's bytes"
        reader.ask("unpin", reading)
        reader.ask("settle")
        # The reader moved on: only the liar can still hold anything back. A garbage "1"
        # holds every freed slot while its session lives (a stall, not a leak) ...
        liar.write(1)
        _churn(a, "marks-churn-2", 512, set())
        liar.close()
        liar = None
        # ... and its session's end gives them back: the engine stores again.
        more, _ = _churn(a, "marks-churn-3", 64, set(), stall_s=10.0)
        assert more == 64, "slots held back by a closed session's marks did not come back"
        # Whatever the garbage, every block is its own key's.
        states, bad = load(a, keys_for("marks-churn-3", 64))
        assert states == [Lookup.HIT] * 64 and bad == []
        settle(a)
    finally:
        if liar is not None:
            liar.close()
        reader.close()
        close_session(a)
    assert_no_slot_leaked(daemon, MODEL)


def test_idle_engines_hold_back_no_freed_slot(start_daemon):
    """An engine that has loaded and gone quiet, and one that attached and never stepped, do
    not keep the namespace's freed slots from coming back: another engine stores several
    pools' worth of blocks (evicting all along) without its reserve drying up."""
    daemon = start_daemon(*SMALL_POOL)
    a = open_session(daemon.socket, MODEL, reserve=16)
    loaded = EngineProcess(daemon.socket, MODEL)
    fresh = EngineProcess(daemon.socket, MODEL)
    keys = keys_for("idle-ready", 8)
    try:
        assert store(a, keys) is not None
        out = loaded.ask("load", keys)
        assert out["states"] == ["hit"] * len(keys) and out["bad"] == []
        loaded.ask("settle")
        stored, _ = _churn(a, "idle-churn", 3 * 128, set(), stall_s=10.0)
        assert stored == 3 * 128, f"only {stored} blocks stored: an idle engine held slots back"
        assert namespace(daemon.stats(), MODEL)["evictions_total"] >= 2 * 128
        states, bad = load(a, keys_for("idle-churn", 3 * 128)[-32:])
        assert states == [Lookup.HIT] * 32 and bad == []
        settle(a)
    finally:
        fresh.close()
        loaded.close()
        close_session(a)
    assert_no_slot_leaked(daemon, MODEL)


def test_a_killed_daemon_costs_the_scheduler_thread_no_call(start_daemon):
    daemon = start_daemon(*SMALL_POOL)
    a = open_session(daemon.socket, MODEL, reserve=16)
    calls = count_blocking_calls(a.client)
    keys = keys_for("daemon-dies", 8)
    try:
        assert store(a, keys) is not None
        states, bad = load(a, keys)
        assert states == [Lookup.HIT] * len(keys) and bad == []
        settle(a)
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(10)

        def degraded() -> bool:
            # The engine keeps stepping while the client notices; whatever it still finds
            # is whole (the pool mapping outlives the daemon).
            _, stale = load(a, keys)
            assert stale == []
            return not a.client.available

        wait_until(degraded, 10, "the engine to notice the daemon is gone")
        for _ in range(20):
            assert [a.lookup(k) for k in keys] == [Lookup.MISS] * len(keys)
            assert a.reserve(keys_for("while-down", 4)) == [], "a store while the daemon is down"
            assert a.start_loads(keys) == [None] * len(keys)
            a.end_step()
            a.has_pending_work()
        assert calls[0] == 0, f"{calls[0]} calls to the daemon on the scheduler thread"
    finally:
        close_session(a)


def assert_floor_follows_the_index(session, key: bytes) -> None:
    """With no load in flight, a new step publishes the index's current reclaim epoch."""
    session.lookup(key)
    assert session._marks.published == session._index.reclaim_epoch
    session.end_step()


def test_a_load_in_flight_at_a_reset_stays_protected_until_the_reset_is_flushed(daemon):
    """vLLM never completes loads from before a reset (it flushes them): their slots must stay
    out of reuse by the session's published epoch until on_reset_flushed, whether or not the
    daemon's pin took."""
    a = open_session(daemon.socket, MODEL, reserve=32)
    keys = keys_for("reset-in-flight", 8)
    try:
        assert store(a, keys) is not None
        assert store(a, keys_for("reset-frees", 8)) is not None   # the reset frees these
        states = [a.lookup(key) for key in keys]
        assert states == [Lookup.HIT] * len(keys)
        a.start_loads(keys)                                   # the copy is in flight; never unpinned
        epoch = a._marks.published
        assert epoch > 0
        a.reset()
        settle(a)
        store(a, keys_for("after-reset", 4))          # frees and grants move the epochs on
        a.lookup(keys[0])                             # a new step publishes its floor
        assert a._index.reclaim_epoch > epoch, "the test needs the reclaim epoch to move"
        assert a._marks.published == epoch, "a load from before the reset lost its protection"
        a.end_step()
        a.reset_flushed()                             # vLLM: every pre-reset copy is done
        settle(a)
        assert_floor_follows_the_index(a, keys[0])
    finally:
        close_session(a)


def test_a_second_reset_before_the_first_is_answered_settles_every_store(daemon):
    """Stores made while a reset is on its way have no epoch until its answer; a second reset
    before that answer makes them stale with the epoch still unknown: flushing must not send
    them with a made-up epoch (it crashed the engine), and once the answers arrive their
    slots come back."""
    a = open_session(daemon.socket, MODEL, reserve=32)
    try:
        assert store(a, keys_for("before-resets", 4)) is not None
        a.reset()                                      # not read by the daemon yet ...
        new, offsets = a.store_slots(keys_for("between-resets", 4), "r")
        assert len(new) == 4
        for key, offset in zip(new, offsets, strict=True):
            write_block(a, offset, key)
        a.reset()                                      # ... nor this one
        a.reset_flushed()                              # vLLM: the copies are done
        a.end_step()
        settle(a)
        a.reset_flushed()
        a.end_step()
        settle(a)
    finally:
        close_session(a)
    assert_no_slot_leaked(daemon, MODEL)


def test_overlapping_loads_of_one_key_each_hold_it_until_done(daemon):
    """Requests load the same blocks in different steps: the session's floor stays at the
    oldest load's epoch until that load completes, each load holds its blocks at the daemon
    until it completes, and nothing stays held."""
    a = open_session(daemon.socket, MODEL, reserve=32)
    keys = keys_for("overlap", 6)

    def pinned_blocks(n: int) -> None:
        settle(a)
        wait_until(lambda: daemon.stats()["blocks"]["pinned"] == n or None, 10,
                   f"{n} blocks pinned at the daemon")

    try:
        assert store(a, keys) is not None
        assert [a.lookup(k) for k in keys] == [Lookup.HIT] * len(keys)
        first = a.start_loads(keys)                                  # request 1, step 1
        floor = a._marks.published
        a.end_step()
        store(a, keys_for("overlap-moves-epochs", 8))        # frees/grants move epochs on
        assert [a.lookup(k) for k in keys[:3]] == [Lookup.HIT] * 3
        assert a.start_loads(keys[:3]) == first[:3]                  # request 2
        a.end_step()
        assert a.lookup(keys[0]) is Lookup.HIT
        a.start_loads(keys[:1])                                      # request 3
        a.end_step()
        pinned_blocks(6)
        a.finish_loads(keys[:3])                                    # one load of each of [:3]
        a.lookup(keys[5])
        assert a._marks.published == floor, "a load in flight lost its protection"
        a.end_step()
        a.finish_loads(keys[3:])                                    # request 1 is done
        pinned_blocks(3)
        a.finish_loads(keys[:3])
        assert a._loads.holding, "keys[0] has a third load in flight"
        pinned_blocks(1)
        a.finish_loads(keys[:1])
        assert not a._loads and not a._loads.holding
        pinned_blocks(0)
        assert_floor_follows_the_index(a, keys[5])
    finally:
        close_session(a)


def test_a_later_request_finishing_first_leaves_the_earlier_loads_protected(start_daemon):
    """Two requests load the same blocks in different steps and the later one finishes
    first: the session must keep publishing the earlier load's epoch (releasing the oldest
    load of a key instead would let a slot the earlier request still reads be reused)."""
    daemon = start_daemon(*SMALL_POOL)
    a = open_session(daemon.socket, MODEL, reserve=16)
    keys = keys_for("attribution", 4)
    try:
        assert store(a, keys) is not None
        assert [a.lookup(k) for k in keys] == [Lookup.HIT] * len(keys)
        a.start_loads(keys, "r1")
        floor = a._marks.published
        a.end_step()
        for n in range(12):        # through 128 slots: evictions, until the freed slots
            # wait in limbo behind r1's epoch (as they must) and the reserve runs dry
            if store(a, keys_for(f"attribution-evicts-{n}", 16), stall_s=2.0) is None:
                break
        assert [a.lookup(k) for k in keys] == [Lookup.HIT] * len(keys)
        assert a._index.reclaim_epoch > floor, "the test needs the epoch to move between loads"
        a.start_loads(keys, "r2")
        a.end_step()
        a.finish_loads(keys[::-1], "r2")          # the later request is done (vLLM's order varies)
        a.lookup(keys[0])
        assert a._marks.published == floor, "r1's loads lost their protection"
        a.end_step()
        a.finish_loads(keys[:2], "r1")            # in parts: key by key, not as the pin it started
        a.lookup(keys[0])
        assert a._marks.published == floor, "r1's remaining loads lost their protection"
        a.end_step()
        a.finish_loads(keys[2:], "r1")
        assert not a._loads and not a._loads.holding
        settle(a)
        assert_floor_follows_the_index(a, keys[0])
    finally:
        close_session(a)
