"""The engine's bookkeeping without a daemon: the reserve of granted slots sizes itself from
what the engine stores (kvd_client/offload/reserve.py), and the loads in flight decide the epoch the
engine publishes (kvd_client/offload/loads.py) however the engine finishes them."""

from __future__ import annotations

import pytest

from kvd_client.offload.loads import LoadTracker
from kvd_client.offload.reserve import DEFAULT_FLOOR, DEFAULT_INITIAL, DEMAND_WINDOW, StoreReserve
from kvd_proto.wire import MAX_GRANTED_SLOTS


def step(reserve: StoreReserve, demand: int, refill: int | None = None) -> list[int] | None:
    """One engine step: grants applied, `demand` slots taken, the target sent."""
    reserve.begin_step()
    got = reserve.take(demand) if demand else []
    reserve.end_step()
    if refill is not None:
        reserve.granted(list(range(10**6, 10**6 + refill)))
    return got


def test_a_new_reserve_holds_its_initial_size_until_it_sees_stores():
    r = StoreReserve()
    assert (r.floor, r.target) == (DEFAULT_FLOOR, DEFAULT_INITIAL)
    assert r.to_send() == (DEFAULT_INITIAL, False)
    assert r.to_send() is None                       # the daemon knows it
    for _ in range(10):
        step(r, 0)
    assert r.target == DEFAULT_INITIAL and r.to_send() is None


def test_a_young_session_holds_at_least_its_initial_size_for_a_window_of_steps():
    """An engine's first steps admit many requests at once while the daemon refills late:
    however small the first steps' demand, the target stays at the initial size until a
    window of steps was seen; then it follows demand."""
    r = StoreReserve()
    r.granted(list(range(DEFAULT_INITIAL)))
    for _ in range(DEMAND_WINDOW - 1):
        step(r, 40, refill=40)
    assert r.target == DEFAULT_INITIAL
    step(r, 40, refill=40)                           # a whole window seen
    assert r.target == int(1.5 * 40)
    small = StoreReserve()
    small.size_for(600)                              # a small pool: a sixteenth of it
    for _ in range(3):
        step(small, 10, refill=10)
    assert small.target == 600 // 16
    burst = StoreReserve()
    burst.granted(list(range(DEFAULT_INITIAL)))
    step(burst, 2 * DEFAULT_INITIAL)                 # more than it holds: declined, counted
    assert burst.declined == 1 and burst.target == 3 * DEFAULT_INITIAL


def test_the_target_follows_peak_demand_and_what_the_refill_lags_behind():
    r = StoreReserve(initial=16)
    r.granted(list(range(1000)))
    for _ in range(5):
        step(r, 40, refill=40)                       # refilled at once: lag 0
    assert r.target == int(1.5 * 40)
    for _ in range(5):
        step(r, 40)                                  # refills stop: 200 taken, unreplaced
    assert r.target == 1.5 * (40 + 160)              # the deficit seen at a step's start
    r.granted(list(range(200)))                      # caught up
    for _ in range(64):                              # a window later, demand fell to 0
        step(r, 0, refill=0)
    assert r.target == DEFAULT_FLOOR
    assert r.to_send() == (DEFAULT_FLOOR, False)


def test_a_declined_store_asks_the_daemon_to_evict_now():
    r = StoreReserve(floor=4, initial=4)
    r.granted([0, 4096])
    assert r.take(3) is None and r.declined == 1 and len(r) == 2
    r.end_step()
    target, evict = r.to_send()
    assert evict and target >= int(1.5 * 3)
    assert r.to_send() is None                       # once


def test_demand_takes_the_reserve_to_a_quarter_of_the_pool_but_never_below_the_floor():
    r = StoreReserve()
    r.size_for(400)
    assert r.target == 100                           # the initial size too
    r.size_for(400)
    for _ in range(3):
        step(r, 500)
    assert r.target == 100
    big_floor = StoreReserve(floor=300)
    big_floor.size_for(400)
    assert big_floor.cap == 300 and big_floor.target == 300
    huge = StoreReserve()
    huge.size_for(10**9)
    assert huge.cap == MAX_GRANTED_SLOTS


def test_slots_far_above_the_target_go_back_after_the_lower_target():
    r = StoreReserve(floor=8, initial=8)
    r.granted(list(range(100)))
    assert r.surplus() == []                         # the daemon has not heard the target
    assert r.to_send() == (8, False)
    back = r.surplus()
    assert len(back) == 92 and len(r) == 8 and set(back) == set(range(8, 100))


def test_a_new_session_starts_from_nothing():
    r = StoreReserve()
    r.granted([1, 2, 3])
    r.to_send()
    r.clear()
    assert len(r) == 0 and r.to_send() == (r.target, False)


# --- loads ------------------------------------------------------------------------------


def keys(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def test_a_load_finished_with_its_keys_in_any_order_ends_whole():
    t = LoadTracker()
    t.start(keys("a", "b", "c"), (5, 1, "r1"))
    assert t.holding and t.floor(9) == 5 and len(t) == 3
    by_reset, unknown = t.finish(keys("c", "a", "b"), "r1")
    assert by_reset == {1: keys("c", "a", "b")} and unknown == 0
    assert not t.holding and t.floor(9) == 9 and len(t) == 0


def test_keys_several_requests_load_are_held_until_each_load_ends():
    t = LoadTracker()
    t.start(keys("a", "b"), (5, 1, "r1"))
    t.start(keys("a", "b"), (7, 1, "r2"))              # a shared prefix, a later step
    assert t.floor(9) == 5
    t.finish(keys("b", "a"), "r2")                    # the later one finishes first
    assert t.floor(9) == 5, "the earlier load's epoch must stay published"
    t.finish(keys("a", "b"), "r1")
    assert not t.holding


def test_a_load_finished_in_parts_or_without_its_request_goes_key_by_key():
    t = LoadTracker()
    t.start(keys("a", "b", "c"), (5, 1, "r1"))
    t.start(keys("a"), (7, 2, "r2"))
    by_reset, unknown = t.finish(keys("a", "zz"), "")  # no request named: the newest load
    assert by_reset == {2: keys("a")} and unknown == 1
    assert t.floor(9) == 5
    by_reset, _ = t.finish(keys("a", "b"), "r1")
    assert by_reset == {1: keys("a", "b")} and t.holding
    by_reset, _ = t.finish(keys("c"), "r1")
    assert by_reset == {1: keys("c")} and not t.holding and len(t) == 0


def test_loads_in_flight_at_a_reset_stay_protected_until_it_is_flushed():
    t = LoadTracker()
    t.start(keys("a", "b"), (5, 1, "r1"))
    t.reset()
    assert t.holding and t.floor(9) == 5 and len(t) == 0
    t.start(keys("c"), (8, 2, "r2"))
    assert {e: sorted(k) for e, k in t.reset_flushed().items()} == {1: keys("a", "b")}
    assert t.floor(9) == 8
    t.finish(keys("c"), "r2")
    assert not t.holding


@pytest.mark.parametrize("finish", ["whole", "parts"])
def test_the_same_request_loading_the_same_keys_twice_ends_one_load_at_a_time(finish):
    t = LoadTracker()
    t.start(keys("a", "b"), (5, 1, "r1"))
    t.start(keys("a", "b"), (6, 1, "r1"))              # reloaded after a preemption
    if finish == "whole":
        t.finish(keys("a", "b"), "r1")
    else:
        t.finish(keys("a"), "r1")
        t.finish(keys("b"), "r1")
    assert t.floor(9) == 5, "the newest ends first: the older epoch stays published"
    t.finish(keys("b", "a"), "r1")
    assert not t.holding


def test_completions_settle_whole_calls_or_key_by_key_with_the_same_answers():
    """A completion of one store call's keys is settled in one go; keys of two calls, a key
    named twice or one not stored take the key-by-key way; either way every completed store
    answers HIT until the daemon has read its completion and is forgotten after."""
    from kvd_client.offload.stores import StoreTracker

    t = StoreTracker()
    a, b = [bytes([i]) * 8 for i in range(4)], [bytes([i]) * 8 for i in range(4, 6)]
    t.add(a, [0, 1, 2, 3], reset_epoch=1, seq=5)
    t.add(b, [4, 5], reset_epoch=1, seq=6)
    assert t.complete(a[:2], "r", True, 7) == ({1: a[:2]}, 0)         # one call's keys
    assert t.complete([a[2], b[0], a[2]], "r", True, 7) == ({1: [a[2], b[0], a[2]]}, 0)
    assert t.complete([b[1], b"nope"], "r", True, 8) == ({1: [b[1]]}, 1)
    assert t.completed.keys() == set(a[:3] + b)
    assert all(t.answer(k, None, 4) == o for k, o in zip(a[:3] + b, [0, 1, 2, 4, 5]))
    t.settle(6)                  # the daemon read the stores' steps, not the completions'
    assert t.completed.keys() == set(a[:3] + b)
    t.settle(7)                  # the daemon read step 7: the completions sent in it
    assert set(t.stores) == {a[3], b[1]} and t.completed.keys() == {b[1]}
    t.settle(8)
    assert set(t.stores) == {a[3]} and not t.completed


def test_the_window_max_is_the_max_of_the_last_window_of_values():
    """The reserve's peak demand and deficit (kvd_client/offload/reserve.py _WindowMax) against
    max() over the same window, through values that rise, fall and leave the window."""
    import random
    from collections import deque

    from kvd_client.offload.reserve import DEMAND_WINDOW, _WindowMax

    rng = random.Random(11)
    window = _WindowMax()
    last: deque[int] = deque(maxlen=DEMAND_WINDOW)
    assert window.max == 0 and window.seen == 0
    for i in range(2000):
        value = rng.choice([0, 0, rng.randint(0, 50), rng.randint(0, 5000)])
        window.add(value)
        last.append(value)
        assert window.max == max(last) and window.seen == min(i + 1, DEMAND_WINDOW)


def test_a_whole_pin_finishes_with_the_completion_it_was_made_with():
    """finish_whole: keys that are exactly the request's newest pin, made with its completion
    record (the compiled pin path), end it and give that record; anything else is left to
    `finish` (the pin stays)."""
    loads = LoadTracker()
    a, b, c = b"a" * 8, b"b" * 8, b"c" * 8
    loads.start_distinct(frozenset((a, b)), (7, 0, "r1"), b"DONE-r1")
    loads.start(["x" * 8], (7, 0, "r2"))                  # no record: the Python path's pin
    assert loads.floor(9) == 7
    assert loads.finish_whole({a, c}, "r1") is None       # not its keys
    assert loads.finish_whole([a, a], "r1") is None       # a key named twice
    assert loads.finish_whole({a, b}, "r9") is None       # not its request
    assert loads.finish_whole(["x" * 8], "r2") is None    # no record made
    assert loads.finish_whole({b, a}, "r1") == b"DONE-r1"
    assert loads.finish_whole({a, b}, "r1") is None       # ended
    assert loads.in_flight == 1 and loads.floor(9) == 7
    assert loads.finish(["x" * 8], "r2") == ({0: ["x" * 8]}, 0)
    assert not loads.holding and loads.floor(9) == 9
