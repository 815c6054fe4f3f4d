"""The engine-side store-threshold filter (kvd_client/offload/admission.py): vLLM 0.33's admission rule,
its bound, and its options, without vLLM or a daemon."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvd_client.offload.admission import (
    DEFAULT_MAX_KEYS,
    MAX_KEYS_LIMIT,
    OfferCounter,
    admission_options,
)


def k(i: int) -> bytes:
    return f"key-{i}".encode()


def ks(ids: list[int]) -> list[bytes]:
    return [k(i) for i in ids]


def all_new(keys: list[bytes]) -> list[bytes]:
    return keys


def stored(*ids: int):
    """A `new_keys` for a cache holding `ids`."""
    present = set(ks(list(ids)))
    return lambda keys: [key for key in keys if key not in present]


def test_a_key_is_admitted_at_its_threshold_th_offer():
    c = OfferCounter(3)
    assert c.admit(ks([1, 2]), all_new) == []
    assert c.admit(ks([1]), all_new) == []
    assert c.admit(ks([1, 2]), all_new) == ks([1])        # 1: third offer; 2: second
    assert c.admit(ks([2]), all_new) == ks([2])
    assert c.skipped == 4
    assert c.count(k(1)) == 3 and c.count(k(2)) == 3


def test_stored_keys_pass_and_are_never_counted_as_skipped():
    """vLLM: the threshold applies to new store candidates only; a block already stored (or
    being stored) stays in the offer, whatever its count."""
    c = OfferCounter(2)
    assert c.admit(ks([1, 2, 3]), stored(2)) == ks([2])
    assert c.skipped == 2


def test_the_cache_is_asked_only_about_keys_below_the_threshold():
    c = OfferCounter(2)
    asked: list[list[bytes]] = []

    def new_keys(keys: list[bytes]) -> list[bytes]:
        asked.append(list(keys))
        return keys

    c.admit(ks([1, 2]), new_keys)
    offer = ks([1, 2])
    assert c.admit(offer, new_keys) is offer               # all due: the offer, untouched
    c.admit(ks([1, 3]), new_keys)
    assert asked == [ks([1, 2]), ks([3])]


def test_counts_are_bounded_and_the_least_recently_offered_age_out():
    c = OfferCounter(2, max_keys=3)
    c.admit(ks([1, 2, 3]), all_new)
    c.admit(ks([1]), all_new)                              # 1 is the most recent now
    c.admit(ks([4]), all_new)                              # evicts 2, the oldest
    assert len(c) == 3
    assert [c.count(k(i)) for i in (1, 2, 3, 4)] == [2, 0, 1, 1]
    assert c.admit(ks([2]), all_new) == []                 # 2 starts from one again


def test_an_offer_never_evicts_its_own_counts_and_still_makes_progress():
    """vLLM: an offer larger than the tracker counts what fits, so offering it again stores
    that part rather than nothing forever."""
    c = OfferCounter(2, max_keys=3)
    offer = ks([1, 2, 3, 4, 5])
    assert c.admit(offer, all_new) == []
    assert c.admit(offer, all_new) == ks([1, 2, 3])
    assert len(c) == 3
    c = OfferCounter(2, max_keys=2)
    c.admit(ks([1, 2]), all_new)
    c.admit(ks([1, 2, 3]), all_new)                        # 1, 2 protected: 3 not counted
    assert c.count(k(3)) == 0 and c.count(k(1)) == 2


def test_a_key_repeated_in_one_offer_counts_each_time_it_was_known():
    c = OfferCounter(2)
    assert c.admit(ks([1, 1]), all_new) == []              # new: counted once
    assert c.count(k(1)) == 1
    assert c.admit(ks([1, 1]), all_new) == ks([1, 1])
    assert c.count(k(1)) == 3


def test_clear_forgets_counts_but_not_the_skipped_total():
    c = OfferCounter(2)
    c.admit(ks([1]), all_new)
    c.clear()
    assert len(c) == 0 and c.skipped == 1


@pytest.mark.parametrize("config, expected", [
    ({}, (0, DEFAULT_MAX_KEYS)),
    ({"store_threshold": 2, "max_tracker_size": 10}, (2, 10)),
    ({"store_threshold": "3", "max_tracker_size": "100"}, (3, 100)),   # JSON strings
    ({"store_threshold": 2.0}, (2, DEFAULT_MAX_KEYS)),
    ({"store_threshold": None}, (0, DEFAULT_MAX_KEYS)),
])
def test_options_read_as_vllm_reads_them(config, expected):
    assert admission_options(config) == expected


@pytest.mark.parametrize("config, message", [
    ({"store_threshold": "x"}, "store_threshold must be an integer, got 'x'"),
    ({"store_threshold": True}, "store_threshold must be an integer"),
    ({"store_threshold": [2]}, "store_threshold must be an integer"),
    ({"store_threshold": 1.5}, "store_threshold must be an integer"),
    ({"store_threshold": -1}, "store_threshold must be between 0 and"),
    ({"max_tracker_size": 0}, "max_tracker_size must be between 1 and"),
    ({"max_tracker_size": MAX_KEYS_LIMIT + 1}, "max_tracker_size must be between"),
])
def test_bad_options_name_the_option(config, message):
    with pytest.raises(ValueError, match=message):
        admission_options(config)


@pytest.mark.parametrize("threshold, max_keys", [(1, 10), (0, 10), (2, 0),
                                                 (2, MAX_KEYS_LIMIT + 1)])
def test_a_filter_needs_a_threshold_of_two_and_a_bounded_tracker(threshold, max_keys):
    with pytest.raises(ValueError, match="must be between"):
        OfferCounter(threshold, max_keys)


class Model:
    """The rule, spelled out over a plain list (oldest first) of [key, count]."""

    def __init__(self, threshold: int, max_keys: int) -> None:
        self.threshold, self.max_keys = threshold, max_keys
        self.entries: list[list] = []
        self.skipped = 0

    def _find(self, key: bytes) -> int:
        return next((i for i, e in enumerate(self.entries) if e[0] == key), -1)

    def admit(self, keys: list[bytes], present: set[bytes]) -> list[bytes]:
        protected = set()
        for key in keys:
            i = self._find(key)
            if i >= 0:
                entry = self.entries.pop(i)
                entry[1] += 1
                self.entries.append(entry)
                protected.add(key)
        room = len(self.entries) - len(protected)
        for key in keys:
            if self._find(key) >= 0:
                continue
            if len(self.entries) >= self.max_keys:
                if room == 0:
                    continue
                self.entries.pop(0)
                room -= 1
            self.entries.append([key, 1])
        counts = dict(self.entries)
        out = [key for key in keys if counts.get(key, 0) >= self.threshold or key in present]
        self.skipped += len(keys) - len(out)
        return out


@settings(max_examples=300, deadline=None)
@given(threshold=st.integers(2, 4), max_keys=st.integers(1, 6),
       offers=st.lists(st.tuples(st.lists(st.integers(0, 9), max_size=8),
                                 st.sets(st.integers(0, 9), max_size=4)), max_size=25))
def test_the_filter_matches_the_reference_model(threshold, max_keys, offers):
    c, model = OfferCounter(threshold, max_keys), Model(threshold, max_keys)
    for ids, present_ids in offers:
        present = set(ks(sorted(present_ids)))
        got = c.admit(ks(ids), lambda keys, p=present: [x for x in keys if x not in p])
        assert got == model.admit(ks(ids), present)
        assert len(c) <= max_keys
        assert [x[0] for x in c._counts.items()] == [e[0] for e in model.entries]
    assert c.skipped == model.skipped
