"""An engine's messages to the daemon as channel records within every bound.

One call of the session may name more keys than one record may carry (MAX_KEYS_PER_CALL, and
a quarter of the up ring in bytes): each function here returns the records that carry it, in
order. A key named twice in one call goes once (the daemon refuses a record that repeats a
key, and would drop its other keys with it).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvd_proto import records as rec
from kvd_proto.wire import MAX_KEYS_PER_CALL

PER_KEY_OVERHEAD = 32        # a key's length byte, position, index and offset, at most


def _chunk(keys: Sequence[bytes], max_record: int) -> int:
    longest = max(map(len, keys)) if keys else 1
    return max(1, min(MAX_KEYS_PER_CALL, (max_record - 1024) // (longest + PER_KEY_OVERHEAD)))


def _unique(keys: Sequence[bytes], *columns: Sequence[int] | None
            ) -> tuple[list[bytes], list[list[int] | None]]:
    """`keys` without repeats (first kept), with the matching entries of each column."""
    keys = list(keys)
    if len(set(keys)) == len(keys):
        return keys, [None if c is None else list(c) for c in columns]
    first: dict[bytes, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    keep = sorted(first.values())
    return [keys[i] for i in keep], [None if c is None else [c[i] for i in keep]
                                     for c in columns]


def store(keys: Sequence[bytes], req_id: str, positions: Sequence[int] | None,
          granted: Sequence[tuple[bytes, int]], max_record: int) -> list[bytes]:
    """StoreGranted: what the engine offered and which granted slot holds which new key."""
    keys, (positions,) = _unique(keys, positions or None)
    where = {key: i for i, key in enumerate(keys)}
    slots = {key: offset for key, offset in granted}
    step = _chunk(keys, max_record)
    out = []
    for start in range(0, max(1, len(keys)), step):
        part = keys[start:start + step]
        mine = [(i - start, slots[k]) for k in part if k in slots
                for i in (where[k],)]
        out.append(rec.encode_store(part, req_id,
                                    positions[start:start + step] if positions else None,
                                    mine))
    return out


def pin(keys: Sequence[bytes], req_id: str, positions: Sequence[int] | None,
        offsets: Sequence[int], max_record: int) -> list[bytes]:
    keys, (positions, offsets_) = _unique(keys, positions or None, offsets)
    assert offsets_ is not None
    step = _chunk(keys, max_record)
    return [rec.encode_pin(keys[i:i + step], req_id,
                           positions[i:i + step] if positions else None, offsets_[i:i + step])
            for i in range(0, max(1, len(keys)), step)]


def complete_store(keys: Sequence[bytes], success: bool, req_id: str, epoch: int,
                   max_record: int) -> list[bytes]:
    keys, _ = _unique(keys)
    step = _chunk(keys, max_record)
    return [rec.encode_complete_store(keys[i:i + step], success, req_id, epoch)
            for i in range(0, max(1, len(keys)), step)]


def complete_load(keys: Sequence[bytes], req_id: str, epoch: int,
                  max_record: int) -> list[bytes]:
    keys, _ = _unique(keys)
    step = _chunk(keys, max_record)
    return [rec.encode_complete_load(keys[i:i + step], req_id, epoch)
            for i in range(0, max(1, len(keys)), step)]


def touch(keys: Sequence[bytes], req_id: str, max_record: int) -> list[bytes]:
    keys, _ = _unique(keys)
    step = _chunk(keys, max_record)
    return [rec.encode_touch(keys[i:i + step], req_id)
            for i in range(0, max(1, len(keys)), step)]


def return_slots(offsets: Sequence[int]) -> list[bytes]:
    step = MAX_KEYS_PER_CALL
    return [rec.encode_return_slots(offsets[i:i + step]) for i in range(0, len(offsets), step)]
