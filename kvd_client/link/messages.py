"""An engine's messages to the daemon as channel records within every bound.

One call of the session may name more keys than one record may carry (MAX_KEYS_PER_CALL, and
a quarter of the up ring in bytes: `per_record` keys, from the namespace's key width): each
function here returns the records that carry it, in order. A key named twice in one call goes
once (the daemon refuses a record that repeats a key, and would drop its other keys with it).
The common call (one record's worth of distinct keys) is encoded at once, without copies.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvd_proto import records as rec
from kvd_proto.wire import MAX_KEYS_PER_CALL

PER_KEY_OVERHEAD = 32        # a key's length byte, position, index and offset, at most


def per_record(max_record: int, key_width: int) -> int:
    """How many keys of at most `key_width` bytes one record of `max_record` bytes carries."""
    return max(1, min(MAX_KEYS_PER_CALL, (max_record - 1024) // (key_width + PER_KEY_OVERHEAD)))


def _distinct(keys: Sequence[bytes]) -> bool:
    return len(set(keys)) == len(keys)


def _unique(keys: Sequence[bytes], *columns: Sequence[int] | None
            ) -> tuple[list[bytes], list[list[int] | None]]:
    """`keys` without repeats (first kept), with the matching entries of each column."""
    first: dict[bytes, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    keep = sorted(first.values())
    return [keys[i] for i in keep], [None if c is None else [c[i] for i in keep]
                                     for c in columns]


def _ranges(n: int, step: int) -> range:
    return range(0, max(1, n), step)


def store(keys: Sequence[bytes], req_id: str, positions: Sequence[int] | None,
          new: Sequence[bytes], slots: Sequence[int], limit: int) -> list[bytes]:
    """StoreGranted: what the engine offered (`keys`) and the granted slot of each new key
    (`new[i]` into `slots[i]`; `new` in the order of `keys`)."""
    if len(keys) <= limit and _distinct(keys):
        if len(new) == len(keys):
            index: Sequence[int] = range(len(keys))
        else:
            fresh = set(new)
            index = [i for i, key in enumerate(keys) if key in fresh]
        return [rec.encode_store(keys, req_id, positions, index, slots)]
    keys, (positions,) = _unique(keys, positions)
    slot_of = dict(zip(new, slots, strict=True))
    out = []
    for start in _ranges(len(keys), limit):
        part = keys[start:start + limit]
        mine = [i for i, k in enumerate(part) if k in slot_of]
        out.append(rec.encode_store(part, req_id,
                                    positions[start:start + limit] if positions else None,
                                    mine, [slot_of[part[i]] for i in mine]))
    return out


def pin(keys: Sequence[bytes], req_id: str, positions: Sequence[int] | None,
        offsets: Sequence[int], limit: int, distinct: bool | None = None) -> list[bytes]:
    """`distinct`: whether the caller knows the keys to be distinct (None: check)."""
    if len(keys) <= limit and (_distinct(keys) if distinct is None else distinct):
        return [rec.encode_pin(keys, req_id, positions, offsets)]
    keys, (positions, offsets_) = _unique(keys, positions, offsets)
    assert offsets_ is not None
    return [rec.encode_pin(keys[i:i + limit], req_id,
                           positions[i:i + limit] if positions else None, offsets_[i:i + limit])
            for i in _ranges(len(keys), limit)]


def _split(keys: Sequence[bytes], limit: int,
           distinct: bool | None = None) -> list[Sequence[bytes]]:
    if len(keys) <= limit and (_distinct(keys) if distinct is None else distinct):
        return [keys]
    keys, _ = _unique(keys)
    return [keys[i:i + limit] for i in _ranges(len(keys), limit)]


def complete_store(keys: Sequence[bytes], success: bool, req_id: str, epoch: int,
                   limit: int) -> list[bytes]:
    return [rec.encode_complete_store(part, success, req_id, epoch)
            for part in _split(keys, limit)]


def complete_load(keys: Sequence[bytes], req_id: str, epoch: int, limit: int,
                  distinct: bool | None = None) -> list[bytes]:
    return [rec.encode_complete_load(part, req_id, epoch)
            for part in _split(keys, limit, distinct)]


def touch(keys: Sequence[bytes], req_id: str, limit: int) -> list[bytes]:
    return [rec.encode_touch(part, req_id) for part in _split(keys, limit)]


def promote(keys: Sequence[bytes], limit: int) -> list[bytes]:
    """PROMOTE: keys answered HIT_PENDING from the "held below" table (distinct already)."""
    return [rec.encode_promote(keys[start:start + limit]) for start in range(0, len(keys), limit)]


def find(step: int, keys: Sequence[bytes], limit: int) -> list[bytes]:
    """FIND: keys to ask the cluster store about (distinct already), all of step `step`."""
    return [rec.encode_find(step, keys[start:start + limit])
            for start in range(0, len(keys), limit)]


def restore(kept: Sequence[tuple[bytes, int]], limit: int) -> list[bytes]:
    """RESTORE: granted slots taken back as the evicted blocks they still hold, (key, offset)
    each (distinct keys), `limit` a record."""
    out = []
    for start in range(0, len(kept), limit):
        part = kept[start:start + limit]
        out.append(rec.encode_restore([key for key, _ in part], [offset for _, offset in part]))
    return out
