"""Taking over one namespace's index as a previous daemon left it, in a few vectorised passes.

The index file holds everything a block needs: its key, its slot, its state. What a warm
restart may serve is exactly the READY slots that pass every check:

- a key length of 1 to the index's key width;
- exactly one bucket names the slot (nothing else points there);
- a lookup of its key finds it (its bytes hash to where the bucket is; of two READY slots
  holding one key, only the one a lookup finds).

STORING slots (a store the crash interrupted) and READY slots that fail a check are dropped:
their meta word becomes FREE (next generation), so no reader's memo of them holds. When any
bucket is wrong (a slot named twice, or a bucket naming a free slot: the daemon died between
the writes of an insert or a remove), every bucket is rebuilt from the slots kept; otherwise
the few interrupted stores are removed one by one. Readers of the previous daemon may probe the
index meanwhile: the read protocol (meta, key, meta again) turns what changes under them into
a miss, never a wrong hit.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from kvd_proto.index_layout import (
    GENERATION_SHIFT,
    KEY_LEN_MASK,
    KEY_LEN_SHIFT,
    STATE_MASK,
    STATE_READY,
    STATE_STORING,
)
from kvd_server.memory.shm_index import ShmIndex


@dataclass(slots=True)
class IndexCheck:
    """What the checks kept of one index: READY slots to serve, and what was dropped."""

    ready: np.ndarray                                     # slot ids, ascending
    dropped: Counter[str] = field(default_factory=Counter)  # reason -> blocks
    rebuilt: bool = False                                  # every bucket was rebuilt


def check_index(index: ShmIndex) -> IndexCheck:
    """Check the adopted `index` and make it hold exactly what it may serve (see the module
    doc)."""
    h = index.header
    meta = index.meta_array()
    state = meta & STATE_MASK
    ready = np.flatnonzero(state == STATE_READY)
    storing = np.flatnonzero(state == STATE_STORING)
    dropped: Counter[str] = Counter()

    key_len = (meta[ready] >> KEY_LEN_SHIFT) & KEY_LEN_MASK
    bad = (key_len == 0) | (key_len > h.key_width)
    dropped["key length out of range"] = int(bad.sum())

    buckets = index.buckets_array()
    named = buckets[buckets != 0].astype(np.int64) - 1
    named = named[named < h.capacity]
    times_named = np.bincount(named, minlength=h.capacity)
    not_once = times_named[ready] != 1
    dropped["not found by its bucket"] = int((not_once & ~bad).sum())
    bad |= not_once

    # Each key kept must be found where it lies: its bytes hash to the bucket that names
    # the slot (a key changed under the daemon's feet is not served under another name), and
    # a key two READY slots hold (a move the crash interrupted) is served from the one a
    # lookup finds: both hold its bytes.
    keep_mask = ~bad
    if keep_mask.any():
        found = index.reachable(ready[keep_mask])
        dropped["not found under its key"] = int((~found).sum())
        keep_mask[np.flatnonzero(keep_mask)[~found]] = False
    keep = ready[keep_mask]

    # Buckets must name exactly the slots kept, once each, and perhaps an interrupted store
    # (the daemon died between its meta and its bucket): anything else and they are rebuilt.
    expected = np.zeros(h.capacity, dtype=bool)
    expected[keep] = True
    expected[storing] = True
    stale = bool(times_named[~expected].any()) or bool((times_named[storing] > 1).any())
    dropped["being stored"] = len(storing)
    drop = np.concatenate([ready[~keep_mask], storing])
    rebuilt = False
    if stale:
        _free_meta(meta, drop)
        _rebuild_buckets(index, keep)
        rebuilt = True
    else:
        for slot in storing.tolist():
            index.remove(int(slot))
    return IndexCheck(keep, +dropped, rebuilt)


def _free_meta(meta: np.ndarray, slots: np.ndarray) -> None:
    """Slots dropped: FREE, in the next generation (a reader's memo of them no longer holds)."""
    if len(slots):
        meta[slots] = ((meta[slots] >> GENERATION_SHIFT) + 1) << GENERATION_SHIFT


def _rebuild_buckets(index: ShmIndex, keep: np.ndarray) -> None:
    """Every bucket from scratch: emptied, then each kept slot's key inserted again (a new
    generation, READY as before)."""
    buckets = index.buckets_array()
    buckets[:] = 0
    meta = index.meta_array()
    keys = [index.key_of(int(slot)) for slot in keep]
    _free_meta(meta, keep)            # insert() publishes each as STORING again, then READY
    for slot, key in zip(keep.tolist(), keys, strict=True):
        if index.insert(slot, key):
            index.set_ready(slot)
