"""Byte layout of one slot, shared by the planner and every backend.

A slot holds one offloaded chunk of one KV group (`blocks_per_chunk` engine blocks of every
tensor the group references) for all ranks: rank r owns bytes [r * shard_bytes, (r + 1) *
shard_bytes). Inside a rank's shard, the group's k-th tensor reference starts at
`group_offsets[g][k]` (its references' pages one after another, `page_bytes[t]` each), so block j
of the chunk sits at `group_offsets[g][k] + j * page_bytes[t]`. A key names one group, so a slot
needs room for the largest group only: hybrid models (full attention + sliding window groups
over one shared allocation) fit the bytes per block vLLM reports. With one group referencing
every tensor in order this is vLLM's CPU layout, per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineTensor:
    """One engine KV tensor seen as rows of blocks: address, row stride, (padded) page size."""

    base: int            # address of block 0 (data_ptr for torch tensors)
    row_stride: int      # bytes between consecutive blocks
    page_bytes: int      # padded page size (the tensor's row length in bytes)
    num_blocks: int


@dataclass(frozen=True, slots=True)
class GroupRef:
    """A layer (or layers sharing bytes) of a KV group: which tensor, how many bytes per page."""

    tensor_idx: int
    copy_bytes: int      # un-padded page size: bytes actually copied per block


@dataclass(frozen=True, slots=True)
class SlotLayout:
    blocks_per_chunk: int
    page_bytes: tuple[int, ...]        # per tensor, padded
    refs_per_group: tuple[tuple[GroupRef, ...], ...]
    num_ranks: int = 1

    @property
    def group_offsets(self) -> tuple[tuple[int, ...], ...]:
        """Per group, where each of its tensor references starts inside a rank's shard."""
        out = []
        for refs in self.refs_per_group:
            offsets, acc = [], 0
            for ref in refs:
                offsets.append(acc)
                acc += self.page_bytes[ref.tensor_idx] * self.blocks_per_chunk
            out.append(tuple(offsets))
        return tuple(out)

    @property
    def shard_bytes(self) -> int:
        if not self.refs_per_group:
            return sum(self.page_bytes) * self.blocks_per_chunk
        return max(sum(self.page_bytes[r.tensor_idx] for r in refs)
                   for refs in self.refs_per_group) * self.blocks_per_chunk

    @property
    def slot_bytes(self) -> int:
        return self.shard_bytes * self.num_ranks


def make_layout(tensors: Sequence[EngineTensor], refs_per_group: Sequence[Sequence[GroupRef]],
                blocks_per_chunk: int, num_ranks: int = 1) -> SlotLayout:
    if blocks_per_chunk < 1:
        raise ValueError("blocks_per_chunk must be >= 1")
    for refs in refs_per_group:
        for ref in refs:
            if not 0 <= ref.tensor_idx < len(tensors):
                raise ValueError(f"group ref names tensor {ref.tensor_idx} of {len(tensors)}")
            if ref.copy_bytes > tensors[ref.tensor_idx].page_bytes:
                raise ValueError("a ref copies more bytes than its tensor's page")
    return SlotLayout(blocks_per_chunk, tuple(t.page_bytes for t in tensors),
                      tuple(tuple(r) for r in refs_per_group), num_ranks)
