"""The fragment planner: which bytes move where for one transfer. Pure numpy, no torch/CUDA.

Turns (engine block ids per KV group, the chunks' slot offsets, the slot layout, this rank) into
coalesced (src address, dst address, length) runs. Every backend executes the same plan, so the
CPU tests cover the layout math the GPU path runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .slot_layout import EngineTensor, GroupRef, SlotLayout

SKIP = -1  # a slot offset that says "this chunk is not transferred" (e.g. a declined store)


@dataclass(frozen=True, slots=True)
class CopyPlan:
    src: np.ndarray       # int64 addresses
    dst: np.ndarray
    lengths: np.ndarray
    total_bytes: int

    def __len__(self) -> int:
        return int(self.lengths.size)


def chunks_for_group(group_size: int, block_index: int, blocks_per_chunk: int) -> int:
    """Chunks covered by `group_size` blocks starting at logical block `block_index`."""
    if group_size == 0:
        return 0
    skip = block_index % blocks_per_chunk
    return -(-(group_size + skip) // blocks_per_chunk)


def plan_transfer(layout: SlotLayout, tensors: Sequence[EngineTensor], *, pool_base: int,
                  rank: int, slot_offsets: Sequence[int] | np.ndarray, block_ids: Sequence[int],
                  group_sizes: Sequence[int], block_indices: Sequence[int],
                  to_pool: bool) -> CopyPlan:
    """Plan a store (`to_pool`) or load of `block_ids` against the chunks at `slot_offsets`.

    `slot_offsets` lists the chunks group after group, `chunks_for_group(...)` per group (the
    order vLLM's specs use); a chunk whose offset is SKIP is left out.
    """
    if len(group_sizes) != len(layout.refs_per_group) or len(block_indices) != len(group_sizes):
        raise ValueError(f"transfer names {len(group_sizes)} groups, layout has "
                         f"{len(layout.refs_per_group)}")
    if sum(group_sizes) != len(block_ids):
        raise ValueError("group_sizes do not add up to the number of block ids")
    if not 0 <= rank < layout.num_ranks:
        raise ValueError(f"rank {rank} outside 0..{layout.num_ranks - 1}")
    bpc = layout.blocks_per_chunk
    ids_all = np.asarray(block_ids, dtype=np.int64)
    offs_all = np.asarray(slot_offsets, dtype=np.int64)
    goff = layout.group_offsets
    rank_base = pool_base + rank * layout.shard_bytes
    engine_parts: list[np.ndarray] = []
    host_parts: list[np.ndarray] = []
    len_parts: list[np.ndarray] = []
    b_start = c_start = 0
    for g, (n, b0) in enumerate(zip(group_sizes, block_indices, strict=True)):
        n_chunks = chunks_for_group(n, b0, bpc)
        if c_start + n_chunks > offs_all.size:
            raise ValueError(f"group {g} needs {n_chunks} chunk slots, only "
                             f"{offs_all.size - c_start} left")
        if n == 0:
            continue
        ids = ids_all[b_start:b_start + n]
        pos = (b0 % bpc) + np.arange(n, dtype=np.int64)
        chunk = pos // bpc
        within = pos % bpc
        slot = offs_all[c_start + chunk]
        keep = slot != SKIP
        if not keep.all():
            ids, within, slot = ids[keep], within[keep], slot[keep]
        refs = layout.refs_per_group[g]
        if ids.size and refs:
            _check_ids(ids, [tensors[ref.tensor_idx] for ref in refs])
            # Every reference of the group at once, reference-major (the order the runs
            # coalesce in): one row of `ids.size` runs per reference.
            base, stride, page, copy = _ref_columns(layout, tensors, refs)
            ref_offset = np.array(goff[g], dtype=np.int64)
            engine_parts.append((base[:, None] + ids * stride[:, None]).ravel())
            host_parts.append((ref_offset[:, None] + (rank_base + slot)
                               + within * page[:, None]).ravel())
            len_parts.append(np.repeat(copy, ids.size))
        b_start += n
        c_start += n_chunks
    if c_start != offs_all.size:
        raise ValueError(f"{offs_all.size} chunk slots given, the blocks cover {c_start}")
    if not len_parts:
        empty = np.zeros(0, dtype=np.int64)
        return CopyPlan(empty, empty, empty, 0)
    engine = np.concatenate(engine_parts)
    host = np.concatenate(host_parts)
    lengths = np.concatenate(len_parts)
    src, dst = (engine, host) if to_pool else (host, engine)
    return coalesce(src, dst, lengths)


def _ref_columns(layout: SlotLayout, tensors: Sequence[EngineTensor],
                 refs: Sequence[GroupRef]) -> tuple[np.ndarray, ...]:
    """Per reference of a group: its tensor's base, row stride and padded page, and the
    bytes it copies per block (int64 columns)."""
    rows = [(tensors[r.tensor_idx].base, tensors[r.tensor_idx].row_stride,
             layout.page_bytes[r.tensor_idx], r.copy_bytes) for r in refs]
    return tuple(np.array(column, dtype=np.int64) for column in zip(*rows, strict=True))


def _check_ids(ids: np.ndarray, tensors: Sequence[EngineTensor]) -> None:
    """Every block id inside every tensor a group references."""
    lo, hi = int(ids.min()), int(ids.max())
    for t in tensors:
        if lo < 0 or hi >= t.num_blocks:
            raise ValueError(f"block id out of range 0..{t.num_blocks - 1}")


def coalesce(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> CopyPlan:
    """Merge runs that continue each other on both sides (vectorised)."""
    total = int(lengths.sum())
    if src.size <= 1:
        return CopyPlan(src, dst, lengths, total)
    ends_src = src[:-1] + lengths[:-1]
    ends_dst = dst[:-1] + lengths[:-1]
    breaks = (src[1:] != ends_src) | (dst[1:] != ends_dst)
    starts = np.concatenate(([0], np.nonzero(breaks)[0] + 1))
    merged = np.add.reduceat(lengths, starts)
    return CopyPlan(src[starts], dst[starts], merged, total)
