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

import errno
import os
from collections import Counter
from collections.abc import Callable
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

CHUNK = 4096          # bytes: what is read or skipped at once (a page of the memory file)


@dataclass(slots=True)
class IndexCheck:
    """What the checks kept of one index: READY slots to serve, and what was dropped."""

    ready: np.ndarray                                     # slot ids, ascending
    dropped: Counter[str] = field(default_factory=Counter)  # reason -> blocks
    rebuilt: bool = False                                  # every bucket was rebuilt
    words_read: int = 0            # meta words and buckets looked at (the rest are holes)


def check_index(index: ShmIndex) -> IndexCheck:
    """Check the adopted `index` and make it hold exactly what it may serve (see the module
    doc).

    Its cost follows what the index holds, not its capacity: an index is sized for the whole
    pool (16M slots for 64 GiB of 4 KiB blocks, 256 MiB of meta words and buckets) and is a
    sparse memory file whose pages exist only where a slot or bucket was ever written. Only
    those pages are read (SEEK_DATA; reading a hole through the mapping would allocate it, for
    good, in the tmpfs), and the buckets are counted per slot named (a sort), not in an array
    of the capacity."""
    h = index.header
    meta = index.meta_array()
    buckets = index.buckets_array()
    spans = _data_spans(index.fd, h.buckets_offset, h.keys_offset)
    meta_chunks = _chunks_in(spans, h.meta_offset, 8 * h.capacity)
    bucket_chunks = _chunks_in(spans, h.buckets_offset, 4 * h.buckets)
    # The state bits are in each meta word's low byte (the words are little-endian): a byte
    # per slot is read and kept in temporaries, not eight.
    words = meta.view(np.uint8)[::8] if STATE_MASK <= 0xFF else meta
    low, slot_ids = _scan(words, meta_chunks, CHUNK // 8)
    state = low & STATE_MASK
    ready = slot_ids(state == STATE_READY)
    storing = slot_ids(state == STATE_STORING)
    dropped: Counter[str] = Counter()

    key_len = (meta[ready] >> KEY_LEN_SHIFT) & KEY_LEN_MASK
    bad = (key_len == 0) | (key_len > h.key_width)
    dropped["key length out of range"] = int(bad.sum())

    named, _ = _scan(buckets, bucket_chunks, CHUNK // 4)
    named = named[named != 0].astype(np.int64) - 1
    named = named[named < h.capacity]                   # each slot once per bucket naming it
    times_named = _counter(named, h.capacity)
    not_once = times_named(ready) != 1
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
    # (Kept and interrupted slots are distinct: the buckets name only them when those names
    # add up to every bucket's.)
    stale = int(times_named(keep).sum() + times_named(storing).sum()) != len(named) \
        or bool((times_named(storing) > 1).any())
    dropped["being stored"] = len(storing)
    drop = np.concatenate([ready[~keep_mask], storing])
    rebuilt = False
    if stale:
        _free_meta(meta, drop)
        _rebuild_buckets(index, keep, bucket_chunks)
        rebuilt = True
    else:
        for slot in storing.tolist():
            index.remove(int(slot))
    words = _words(meta_chunks, h.capacity, CHUNK // 8) \
        + _words(bucket_chunks, h.buckets, CHUNK // 4)
    return IndexCheck(keep, +dropped, rebuilt, words)


def _data_spans(fd: int, start: int, end: int) -> list[tuple[int, int]] | None:
    """The byte spans of [start, end) of the memory file `fd` that have pages, in order; None
    when it cannot say (no descriptor: an index in anonymous memory)."""
    if fd < 0:
        return None
    spans: list[tuple[int, int]] = []
    pos = start
    try:
        while pos < end:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:        # nothing but a hole past `pos`
                    break
                raise
            if data >= end:
                break
            pos = min(os.lseek(fd, data, os.SEEK_HOLE), end)
            spans.append((data, pos))
    except OSError:
        return None
    finally:
        # Engines are handed this descriptor's file description (they only map it).
        os.lseek(fd, 0, os.SEEK_SET)
    return spans


def _chunks_in(spans: list[tuple[int, int]] | None, offset: int, nbytes: int
               ) -> np.ndarray | None:
    """Numbers (ascending) of the CHUNK-sized pieces of the region of `nbytes` at `offset`
    that meet `spans`; None: every piece (no spans known, or the region is in pages whole)."""
    if spans is None:
        return None
    count = -(-nbytes // CHUNK)
    firsts: list[int] = []
    stops: list[int] = []
    for lo, hi in spans:
        if hi > offset and lo < offset + nbytes:
            firsts.append(max(0, (lo - offset) // CHUNK))
            stops.append(min(count, -(-(hi - offset) // CHUNK)))
    first = np.array(firsts, dtype=np.int64)
    lengths = np.array(stops, dtype=np.int64) - first
    total = int(lengths.sum())
    if total >= count:
        return None
    # Each span's pieces back to back, in one vectorised pass (a span per page at worst).
    return np.repeat(first - (np.cumsum(lengths) - lengths), lengths) + np.arange(total)


def _scan(words: np.ndarray, chunks: np.ndarray | None, per_chunk: int
          ) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]:
    """The words of `chunks` (of `per_chunk` words; None: every word) and the function that
    turns a mask over them into the ascending ids of the words it selects. The pieces are
    gathered as rows of one array, the last one padded with zeros (a zero word is a free slot
    or an empty bucket: nothing the checks select)."""
    if chunks is None:
        return words, np.flatnonzero
    whole = len(words) // per_chunk
    rows = chunks[chunks < whole]
    grid = words[:whole * per_chunk].reshape(whole, per_chunk)[rows]
    if len(rows) < len(chunks):                       # the last piece, shorter than a chunk
        tail = np.zeros((1, per_chunk), dtype=words.dtype)
        rest = words[whole * per_chunk:]
        tail[0, :len(rest)] = rest
        grid = np.concatenate([grid, tail])
        rows = np.append(rows, whole)

    def ids(mask: np.ndarray) -> np.ndarray:
        row, col = np.nonzero(mask)
        return rows[row] * per_chunk + col

    return grid, ids


def _words(chunks: np.ndarray | None, count: int, per_chunk: int) -> int:
    """How many of a region's `count` words a scan of `chunks` reads."""
    return count if chunks is None else min(count, len(chunks) * per_chunk)


def _counter(named: np.ndarray, capacity: int) -> Callable[[np.ndarray], np.ndarray]:
    """How many buckets name each of some slots, from `named` (the slot each naming bucket
    names): a count per slot of the index when it holds many blocks, else a sorted copy of
    `named` searched (what an index of few blocks costs follows them, not its capacity)."""
    if len(named) * 16 >= capacity:
        counts = np.bincount(named, minlength=capacity)
        return lambda slots: counts[slots]
    ordered = np.sort(named)
    return lambda slots: (np.searchsorted(ordered, slots, "right")
                          - np.searchsorted(ordered, slots, "left"))


def _free_meta(meta: np.ndarray, slots: np.ndarray) -> None:
    """Slots dropped: FREE, in the next generation (a reader's memo of them no longer holds)."""
    if len(slots):
        meta[slots] = ((meta[slots] >> GENERATION_SHIFT) + 1) << GENERATION_SHIFT


def _rebuild_buckets(index: ShmIndex, keep: np.ndarray, chunks: np.ndarray | None) -> None:
    """Every bucket from scratch: emptied (those in `chunks`: the holes are empty already),
    then each kept slot's key inserted again (a new generation, READY as before)."""
    buckets = index.buckets_array()
    if chunks is None:
        buckets[:] = 0
    else:
        per = CHUNK // 4
        for chunk in chunks.tolist():
            buckets[chunk * per:(chunk + 1) * per] = 0
    meta = index.meta_array()
    keys = [index.key_of(int(slot)) for slot in keep]
    _free_meta(meta, keep)            # insert() publishes each as STORING again, then READY
    for slot, key in zip(keep.tolist(), keys, strict=True):
        if index.insert(slot, key):
            index.set_ready(slot)
