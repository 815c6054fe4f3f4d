"""NamespaceManager against a small reference model (hypothesis stateful), plus zombies/epochs.

The model tracks only what a user can observe: which keys are readable, which are being
stored, how many pins each holds, and which slots are in use (by live blocks or zombies).
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvd_server.errors import NotReady
from kvd_server.manager import FixedSlots, Lookup, NamespaceManager

KEYS = [bytes([i]) + b"\0\0\0\0" for i in range(12)]
CAPACITY = 5


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.slots = FixedSlots(CAPACITY)
        self.m = NamespaceManager(self.slots, "lru")
        self.state: dict[bytes, str] = {}        # key -> "storing" | "ready"
        self.pins: dict[bytes, int] = {}
        self.zombie_pins: list[tuple[int, bytes]] = []
        self.zombie_stores: list[tuple[int, bytes]] = []

    keys = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True)

    @rule(keys=keys)
    def prepare_store(self, keys):
        grant = self.m.prepare_store(keys, "r")
        if grant is None:
            # Only ever for lack of room: some offered key must be new.
            assert any(key not in self.state for key in keys)
            return
        for key in grant.keys_to_store:
            assert key not in self.state
            self.state[key] = "storing"
        for key in grant.evicted_keys:
            assert self.state.pop(key) == "ready"
            assert self.pins.get(key, 0) == 0
            assert key not in keys

    @rule(keys=keys, success=st.booleans())
    def complete_store(self, keys, success):
        changed = self.m.complete_store(keys, success, "r")
        expect = [k for k in keys if self.state.get(k) == "storing"]
        assert changed == len(expect)
        for key in expect:
            if success:
                self.state[key] = "ready"
            else:
                del self.state[key]

    @rule(keys=keys)
    def load(self, keys):
        ready = all(self.state.get(k) == "ready" for k in keys)
        try:
            self.m.prepare_load(keys, "r")
        except NotReady:
            assert not ready
            return
        assert ready
        for key in keys:
            self.pins[key] = self.pins.get(key, 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def complete_load(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, v in self.pins.items() if v)))
        self.m.complete_load([key], "r")
        self.pins[key] -= 1

    @rule(key=st.sampled_from(KEYS))
    def lease(self, key):
        ok = self.m.lease(key)
        assert ok == (self.state.get(key) == "ready")
        if ok:
            self.pins[key] = self.pins.get(key, 0) + 1

    @rule()
    def finish_request(self):
        self.m.request_finished("r")

    @rule()
    def reset(self):
        epoch = self.m.epoch
        for key, st_ in self.state.items():
            if st_ == "storing":
                self.zombie_stores.append((epoch, key))
            for _ in range(self.pins.get(key, 0)):
                self.zombie_pins.append((epoch, key))
        self.m.reset()
        self.state.clear()
        self.pins.clear()

    @precondition(lambda self: self.zombie_pins or self.zombie_stores)
    @rule(data=st.data())
    def finish_old_copy(self, data):
        if self.zombie_pins and data.draw(st.booleans()):
            epoch, key = self.zombie_pins.pop(data.draw(
                st.integers(0, len(self.zombie_pins) - 1)))
            self.m.complete_load([key], "r", epoch=epoch)
        elif self.zombie_stores:
            epoch, key = self.zombie_stores.pop(data.draw(
                st.integers(0, len(self.zombie_stores) - 1)))
            self.m.complete_store([key], data.draw(st.booleans()), "r", epoch=epoch)

    @invariant()
    def lookups_match(self):
        for key in KEYS:
            expect = {"ready": Lookup.HIT, "storing": Lookup.HIT_PENDING}.get(
                self.state.get(key), Lookup.MISS)
            assert self.m.lookup(key) is expect

    @invariant()
    def slots_are_exclusive_and_accounted(self):
        live = [self.m.slot_of(k) for k in self.state]
        zombies = self.m._zombies.slots()
        used = live + zombies
        assert len(used) == len(set(used)), "a slot is shared"
        assert all(0 <= s < CAPACITY for s in used)
        assert self.slots.free_count() + len(used) == CAPACITY
        counts = self.m.counts()
        assert counts.storing == sum(1 for v in self.state.values() if v == "storing")
        assert counts.pinned == sum(1 for k, v in self.state.items()
                                    if v == "ready" and self.pins.get(k, 0))
        # a zombie is never visible and never shares a slot (checked above)
        assert counts.zombie == len(zombies)


ManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                            deadline=None)
TestManagerModel = ManagerMachine.TestCase


def test_reset_keeps_in_flight_slots_until_their_completion():
    slots = FixedSlots(2)
    m = NamespaceManager(slots, "lru")
    g = m.prepare_store([b"a0000", b"b0000"], "r")
    m.complete_store([b"a0000"], True, "r")
    m.prepare_load([b"a0000"], "r")                  # a pinned, b storing
    assert m.reset() == 2
    assert m.epoch == 1 and m.counts().zombie == 2
    assert m.prepare_store([b"c0000"], "r") is None   # both slots still in use
    m.complete_store([b"b0000"], True, "r", epoch=0)  # old store ends: slot freed, not visible
    assert m.lookup(b"b0000") is Lookup.MISS
    g2 = m.prepare_store([b"c0000"], "r")
    assert g2.slots == [g.slots[1]]
    m.complete_load([b"a0000"], "r", epoch=0)
    assert m.counts().zombie == 0 and slots.free_count() == 1


def test_old_epoch_completion_never_touches_new_blocks():
    m = NamespaceManager(FixedSlots(2), "lru")
    m.prepare_store([b"a0000"], "r")
    m.reset()
    m.prepare_store([b"a0000"], "r")                  # same key, new epoch
    m.complete_store([b"a0000"], True, "r", epoch=0)  # stale completion
    assert m.lookup(b"a0000") is Lookup.HIT_PENDING
    m.complete_store([b"a0000"], True, "r", epoch=1)
    assert m.lookup(b"a0000") is Lookup.HIT


def test_unknown_completions_are_ignored():
    m = NamespaceManager(FixedSlots(2), "arc")
    m.complete_load([b"x0000"], "r")
    m.release_lease(b"x0000")
    assert m.complete_store([b"x0000"], True, "r") == 0
    assert m.counts().resident == 0
