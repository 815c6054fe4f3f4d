"""The promotions an engine asks for (kvd_client/offload/promotions.py): a promoted key reads HIT from
the index and never comes back to `answer`, so its ask must still be forgotten: once
MAX_ASKED asks are remembered, the settled ones are swept (at most once a step) before a new
key is refused."""

from __future__ import annotations

import pytest

from kvd_client.link.index_reader import STATE_READY, STATE_STORING
from kvd_client.offload import promotions as promotions_module
from kvd_client.offload.promotions import Promotions


def held(_key: bytes) -> bool:
    return True


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(promotions_module, "MAX_ASKED", 4)


def test_settled_asks_are_swept_when_full_so_later_keys_are_still_promoted(small):
    p = Promotions()
    keys = [bytes([i]) * 8 for i in range(6)]
    assert all(p.answer(k, 1, 0, held) for k in keys[:4])        # asked at step 1
    assert p.take() == keys[:4]
    # The daemon read step 1: two came in (READY in the index), two are still being read.
    index = {keys[0]: (STATE_READY, 0), keys[1]: (STATE_READY, 4096),
             keys[2]: (STATE_STORING, 8192), keys[3]: (STATE_STORING, 12288)}
    assert not p.answer(keys[4], 2, 1, held)                    # full, no probe: a MISS
    assert p.answer(keys[5], 3, 1, held, index.get)             # swept: room for it
    assert set(p.asked) == {keys[2], keys[3], keys[5]} and p.take() == [keys[5]]


def test_a_full_table_of_running_promotions_is_swept_once_a_step(small):
    p = Promotions()
    keys = [bytes([i]) * 8 for i in range(6)]
    assert all(p.answer(k, 1, 0, held) for k in keys[:4])
    probes = []

    def storing(key: bytes):
        probes.append(key)
        return (STATE_STORING, 0)

    assert not p.answer(keys[4], 2, 1, held, storing)           # all still running
    assert not p.answer(keys[5], 2, 1, held, storing)           # same step: no sweep again
    assert len(probes) == 4
    assert not p.answer(keys[5], 3, 1, held, storing) and len(probes) == 8
