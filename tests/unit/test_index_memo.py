"""IndexReader's per-key memo and `expect_ready`: a remembered answer is used only while the
slot's meta word is unchanged, so it can never outlive the block it describes."""

from __future__ import annotations

import hashlib
import os

import pytest

from kvd_client.link.index_reader import STATE_READY, STATE_STORING, IndexReader
from kvd_server.memory.shm_index import ShmIndex

STRIDE = 4096
PER_EXTENT = 64


def _key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


@pytest.fixture()
def pair():
    index = ShmIndex(256, 40, PER_EXTENT, STRIDE, PER_EXTENT * STRIDE)
    reader = IndexReader(os.dup(index.fd))
    yield index, reader
    reader.close()
    index.close()


def _offset(slot: int) -> int:
    return slot // PER_EXTENT * PER_EXTENT * STRIDE + slot % PER_EXTENT * STRIDE


def test_memo_follows_every_change_of_the_slot(pair) -> None:
    index, reader = pair
    a, b = _key(1), _key(2)
    index.insert(70, a)
    assert reader.find(a) == (STATE_STORING, _offset(70))
    index.set_ready(70)
    assert reader.find(a) == (STATE_READY, _offset(70))
    assert reader.find(a) == (STATE_READY, _offset(70))        # from the memo
    index.remove(70)
    assert reader.find(a) is None
    index.insert(70, b)                                         # the same slot, another key
    index.set_ready(70)
    assert reader.find(a) is None
    assert reader.find(b) == (STATE_READY, _offset(70))
    index.clear()
    assert reader.find(b) is None


def test_expect_ready_remembers_only_the_store_it_saw(pair) -> None:
    index, reader = pair
    a, b = _key(3), _key(4)
    reader.expect_ready(a, _offset(5))           # not published yet: nothing remembered
    assert a not in reader.memo
    index.insert(5, a)
    reader.expect_ready(b, _offset(5))           # another key's slot: nothing
    assert b not in reader.memo
    reader.expect_ready(a, _offset(5) + 1)       # not a slot's offset: nothing
    reader.expect_ready(a, _offset(5))
    assert reader.find(a) == (STATE_STORING, _offset(5))   # the memo waits for READY
    index.set_ready(5)
    assert reader.find(a) == (STATE_READY, _offset(5))
    # The store lost (the daemon freed the slot and reused it): the memo is not believed.
    index.remove(5)
    index.insert(5, a)
    assert reader.find(a) == (STATE_STORING, _offset(5))


def test_memo_is_bounded(pair) -> None:
    index, _ = pair
    reader = IndexReader(os.dup(index.fd), memo_limit=8)
    try:
        for i in range(40):
            index.insert(i, _key(i))
            index.set_ready(i)
            assert reader.find(_key(i)) == (STATE_READY, _offset(i))
            assert len(reader.memo) <= 8
    finally:
        reader.close()
