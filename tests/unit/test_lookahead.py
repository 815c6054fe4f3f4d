"""The compiled lookups' lookahead (kvd_proto/_native.c, lookahead()): reading a request's next
keys in one batch changes no answer. Within a step (between two settings of `enabled`, the
index unchanged) every lookup answers as its Python twin does and records the same HITs,
whatever order the keys come in and whatever the context holds; a key read ahead as READY and
freed later in the step is still the HIT the twin would have answered at that moment (its slot
is not reused before the engine's next epoch), and the next step reads the index again."""

from __future__ import annotations

import random

import pytest

from kvd_proto.index_layout import STATE_READY, Header, buckets_for
from kvd_proto.native import PyIndexTable, PyLookups

try:
    from kvd_proto import _native
except ImportError:                      # no compiler at install: the twins only
    _native = None

pytestmark = pytest.mark.skipif(_native is None, reason="kvd_proto._native was not built")

WIDTH = 40


class Context:
    """vLLM's ReqContext as far as the lookahead reads it: the request's keys in order."""

    def __init__(self, keys: list[bytes]) -> None:
        self._offload_key_positions = {k: 16 * (i + 1) for i, k in enumerate(keys)}


class World:
    """An index (capacity 512) some keys are READY in, some STORING; a writer to change it."""

    def __init__(self, seed: int) -> None:
        import mmap

        self.h = Header(capacity=512, buckets=buckets_for(512), key_width=WIDTH,
                        per_extent=64, stride=4096, extent_bytes=64 * 4096)
        self.m = mmap.mmap(-1, self.h.file_bytes)
        self.m[:len(self.h.pack())] = self.h.pack()
        self.writer = PyIndexTable(self.m, *self.h.geometry)
        self.meta = memoryview(self.m)[self.h.meta_offset:
                                       self.h.meta_offset + 8 * self.h.capacity].cast("Q")
        self.rng = random.Random(seed)
        self.keys = [self.rng.randbytes(36) for _ in range(300)]
        self.slot: dict[bytes, int] = {}
        for i, key in enumerate(self.keys[:200]):
            self.put(key, i, ready=self.rng.random() < 0.9)

    def put(self, key: bytes, slot: int, ready: bool = True) -> None:
        assert self.writer.insert(slot, key)
        if ready:
            self.meta[slot] = self.meta[slot] & ~3 | STATE_READY
        self.slot[key] = slot

    def free(self, key: bytes) -> None:
        self.writer.remove(self.slot.pop(key))

    def lookups(self, kind: type) -> object:
        lk = kind({}, "MISS", "HIT", lambda k: "SLOW")
        lk.bind(self.m, *self.h.geometry)
        lk.enabled = 1
        return lk

    def close(self, *lookups: object) -> None:
        for lk in lookups:
            lk.unbind()
        self.meta.release()
        self.writer.release()
        self.m.close()


@pytest.mark.parametrize("seed", range(6))
def test_a_step_of_lookups_answers_as_the_twin_whatever_the_order(seed):
    """Requests looked up from a start chunk until their first miss (vLLM's order), some
    from the end backwards, some at random, some without a context, contexts that name keys
    twice or other objects, two requests interleaved: every answer and every HIT recorded as
    the twin's."""
    world = World(seed)
    rng = world.rng
    compiled = world.lookups(_native.Lookups)
    twin = world.lookups(PyLookups)
    recorded: list[dict[bytes, int]] = []
    for _ in range(60):
        keys = rng.sample(world.keys, rng.randint(1, 80))
        ctx = Context(keys)
        order = list(range(rng.randrange(len(keys)), len(keys)))
        shape = rng.random()
        if shape < 0.15:
            order.reverse()
        elif shape < 0.3:
            rng.shuffle(order)
        elif shape < 0.4:
            ctx._offload_key_positions["other"] = 1          # not a bytes key
        elif shape < 0.5:
            ctx = Context([bytes(k) for k in keys])           # equal keys, other objects
        for i in order:
            args = (keys[i],) if shape > 0.95 else (keys[i], ctx)
            answer = compiled.lookup(*args)
            assert answer == twin.lookup(*args)
            if shape >= 0.5 and answer == "MISS":
                break                                         # vLLM stops at a miss
        if rng.random() < 0.2:                                # the step ends
            recorded.append(compiled.recorded())
            assert recorded[-1] == twin.recorded()
            compiled.enabled = twin.enabled = 1
            compiled.clear_hits()
            twin.clear_hits()
    assert compiled.recorded() == twin.recorded() and recorded
    assert (compiled.lookups, compiled.hits, compiled.misses) == \
        (twin.lookups, twin.hits, twin.misses)
    assert compiled.read_ahead > 0
    world.close(compiled, twin)


def test_a_key_read_ahead_keeps_its_step_answer_and_the_next_step_reads_again():
    world = World(7)
    ready = [k for k in world.keys[:200]
             if world.meta[world.slot[k]] & 3 == STATE_READY][:6]
    absent = world.keys[250]
    lk = world.lookups(_native.Lookups)
    ctx = Context(ready + [absent])
    assert lk.lookup(ready[0], ctx) == "HIT"                  # reads the next keys too
    assert lk.read_ahead == len(ready) + 1
    gone = ready[1]
    offset = world.h.offset_of(world.slot[gone])
    world.free(gone)                                           # freed during the step
    world.put(absent, 300)                                     # stored during the step
    assert lk.lookup(gone, ctx) == "HIT" and lk.hit_offset(gone) == offset
    assert lk.lookup(ready[2], ctx) == "HIT"
    lk.enabled = 1                                             # the next step
    lk.clear_hits()
    assert lk.lookup(gone, ctx) == "MISS" and lk.hit_offset(gone) is None
    assert lk.lookup(absent, ctx) == "HIT"
    world.close(lk)


def test_a_context_changed_between_lookups_costs_no_wrong_answer():
    """The context's dict emptied, refilled with other keys and replaced while its lookups
    go on: the keys read ahead are held by the lookups (no dangling pointer), and what was
    read ahead answers as the index says."""
    world = World(8)
    lk = world.lookups(_native.Lookups)
    twin = world.lookups(PyLookups)
    keys = world.keys[:40]
    ctx = Context(keys)
    assert lk.lookup(keys[0], ctx) == twin.lookup(keys[0])
    ctx._offload_key_positions.clear()
    for key in keys[1:10]:
        assert lk.lookup(key, ctx) == twin.lookup(key)
    ctx._offload_key_positions = {k: 1 for k in reversed(keys)}
    for key in keys[10:]:
        assert lk.lookup(key, ctx) == twin.lookup(key)
    del ctx
    for key in world.keys[200:]:                                # other contexts, other keys
        assert lk.lookup(key, Context([key])) == twin.lookup(key)
    world.close(lk, twin)


def test_a_context_the_lookahead_cannot_read_is_looked_up_key_by_key():
    world = World(9)
    lk = world.lookups(_native.Lookups)
    twin = world.lookups(PyLookups)

    class Raising:
        @property
        def _offload_key_positions(self):
            raise RuntimeError("not here")

    for ctx in (object(), Raising(), 5, "ctx"):
        for key in world.keys[:30]:
            assert lk.lookup(key, ctx) == twin.lookup(key, ctx)
    assert lk.read_ahead == 0
    world.close(lk, twin)


def test_a_context_whose_table_looks_up_again_costs_nothing_wrong():
    """The context's attribute is Python code that looks up other keys (of another context)
    while the lookahead reads it: no reference is lost or kept, every answer is the twin's."""
    world = World(10)
    lk = world.lookups(_native.Lookups)
    twin = world.lookups(PyLookups)
    keys = world.keys[:30]
    other = Context(world.keys[100:130])

    class Reentrant:
        @property
        def _offload_key_positions(self):
            for key in world.keys[100:110]:
                assert lk.lookup(key, other) == twin.lookup(key)
            return {k: 1 for k in keys}

    import sys

    watched = world.keys[100:110] + keys
    before = [sys.getrefcount(k) for k in watched]
    ctx = Reentrant()
    for key in keys:
        assert lk.lookup(key, ctx) == twin.lookup(key)
    assert lk.recorded() == twin.recorded()
    del key
    lk.clear_hits()
    twin.clear_hits()
    lk.enabled = twin.enabled = 1             # drops what was read ahead
    assert [sys.getrefcount(k) for k in watched] == before
    world.close(lk, twin)
