"""This step's HITs as the compiled Lookups keep them (a log found by identity, moved into a
dict when it is full or a key must be found by value: kvd_proto/_native.c, "this step's
HITs") against the twin's dict: the same offsets for every key, whatever object names it, and
the compiled pin loads what the Python path (the twin's `hit_offset`) would."""

from __future__ import annotations

import random

import pytest

from kvd_proto.native import PyLookups

try:
    from kvd_proto import _native
except ImportError:                      # no compiler at install: the twins only
    _native = None

pytestmark = pytest.mark.skipif(_native is None, reason="kvd_proto._native was not built")


def both() -> list[object]:
    return [kind({}, "MISS", "HIT", lambda k: "SLOW") for kind in (PyLookups, _native.Lookups)]


def answers(lookups: list[object], call: str, *args: object) -> object:
    got = [getattr(lk, call)(*args) for lk in lookups]
    assert got[0] == got[1], (call, got)
    return got[0]


@pytest.mark.parametrize("seed", range(4))
def test_hits_are_found_by_the_same_key_or_an_equal_one(seed):
    rng = random.Random(seed)
    lookups = both()
    keys = [rng.randbytes(36) for _ in range(600)]
    for _ in range(6):
        for _ in range(rng.randint(0, 900)):
            key, offset = rng.choice(keys), 4096 * rng.randrange(1 << 28)
            for lk in lookups:
                lk.hit(key, offset)
        for _ in range(200):
            key = rng.choice(keys)
            if rng.random() < 0.3:
                key = bytes(bytearray(key))            # an equal key, another object
            answers(lookups, "hit_offset", key)
        assert answers(lookups, "recorded") is not None
        for lk in lookups:
            lk.clear_hits()
        assert answers(lookups, "recorded") == {}


def test_a_later_hit_of_a_key_is_the_one_found():
    lookups = both()
    key = b"k" * 36
    for offset in (4096, 8192):
        for lk in lookups:
            lk.hit(key, offset)
    assert answers(lookups, "hit_offset", key) == 8192
    assert answers(lookups, "hit_offset", bytes(bytearray(key))) == 8192


@pytest.mark.parametrize("count", [5000, 70000])
def test_a_long_step_of_hits_loses_none(count):
    """Past the identity scan's reach (4,096 entries) and past the log's size (65,536): the
    log moves into the dict and every HIT is still found, by either object."""
    lookups = both()
    keys = [i.to_bytes(4, "little") * 9 for i in range(count)]
    for i, key in enumerate(keys):
        for lk in lookups:
            lk.hit(key, 4096 * i)
    for i in (0, 1, count // 2, count - 1):
        assert answers(lookups, "hit_offset", keys[i]) == 4096 * i
        assert answers(lookups, "hit_offset", bytes(bytearray(keys[i]))) == 4096 * i
    assert len(answers(lookups, "recorded")) == count


def test_a_pin_finds_a_requests_hits_among_the_steps_others():
    rng = random.Random(5)
    lookups = both()
    requests = [[rng.randbytes(36) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    for r, keys in enumerate(requests):
        for i, key in enumerate(keys):
            for lk in lookups:
                lk.hit(key, 4096 * (100 * r + i))
    for r in rng.sample(range(12), 12):
        keys = requests[r]
        part = keys[rng.randrange(len(keys)):]
        if r % 3 == 0:
            part = [bytes(bytearray(k)) for k in part]  # equal keys, other objects
        twin, compiled = lookups
        pinned = compiled.pin(part, None, f"req-{r}", 64, 3)
        assert pinned is not None
        assert pinned[0] == [twin.hit_offset(k) for k in part]
        assert pinned[0] == [4096 * (100 * r + keys.index(k)) for k in part]
    assert lookups[1].pin([b"x" * 36], None, "req", 64, 3) is None  # no HIT


def test_a_hit_must_be_bytes_at_a_byte_offset():
    for lk in both():
        with pytest.raises(TypeError):
            lk.hit("text", 4096)
    with pytest.raises((TypeError, OverflowError)):
        _native.Lookups({}, "MISS", "HIT", lambda k: "SLOW").hit(b"k", -1)


def test_a_hit_of_a_bytes_subclass_is_kept_as_plain_bytes():
    class Key(bytes):
        def __hash__(self) -> int:
            raise AssertionError("a subclass's Python code ran inside the HIT log")

        def __eq__(self, other: object) -> bool:
            raise AssertionError("a subclass's Python code ran inside the HIT log")

    lk = _native.Lookups({}, "MISS", "HIT", lambda k: "SLOW")
    lk.hit(Key(b"k" * 36), 4096)
    for i in range(5000):
        lk.hit(i.to_bytes(4, "little") * 9, 8192)
    assert lk.hit_offset(b"k" * 36) == 4096
    assert type(next(iter(lk.recorded()))) is bytes
