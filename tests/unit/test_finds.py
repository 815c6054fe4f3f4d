"""What an engine answers for a key held nowhere on its node, in a namespace shared through a
cluster store (kvd_client/offload/finds.py): asked once, "not known yet" until the daemon's
FOUND for that step (then a MISS if the store did not hold it, the held-below table answering
otherwise), not asked again for NEGATIVE_S, given up after WAIT_S, bounded a step."""

from __future__ import annotations

import pytest

from kvd_client.offload import finds as finds_module
from kvd_client.offload.finds import MAX_PER_STEP, Finds


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(finds_module.time, "monotonic", c)
    return c


def test_a_key_is_asked_once_and_waits_for_its_steps_answer(clock):
    f = Finds()
    assert f.answer(b"k", step=3) is True               # asked: not known yet
    assert f.answer(b"k", step=3) is True and f.take() == [b"k"]
    assert f.answer(b"k", step=4) is True and f.take() == []    # not asked twice
    assert f.waiting()
    f.found(2)                                          # an earlier step's answer
    assert f.answer(b"k", step=5) is True
    f.found(3)                                          # its answer: not held below, so absent
    assert not f.waiting()
    assert f.answer(b"k", step=6) is False
    clock.now += finds_module.NEGATIVE_S / 2
    assert f.answer(b"k", step=7) is False and f.take() == []   # absent lately: not asked
    clock.now += finds_module.NEGATIVE_S
    assert f.answer(b"k", step=8) is True and f.take() == [b"k"]   # asked again


def test_an_answer_that_never_comes_is_a_miss_after_wait_s(clock):
    f = Finds()
    assert f.answer(b"k", step=1)
    clock.now += finds_module.WAIT_S
    assert f.answer(b"k", step=2) is False and not f.waiting()


def test_a_step_asks_at_most_max_per_step_keys(clock):
    f = Finds()
    asked = [f.answer(i.to_bytes(4, "little"), step=1) for i in range(MAX_PER_STEP + 10)]
    assert asked.count(True) == MAX_PER_STEP and len(f.take()) == MAX_PER_STEP
    assert f.answer(b"next", step=2) is True            # the next step asks again


def test_a_new_connection_forgets_the_asks(clock):
    f = Finds()
    f.answer(b"k", step=1)
    f.found(1)
    f.clear()
    assert f.answered == -1 and f.take() == [] and f.answer(b"k", step=1) is True
