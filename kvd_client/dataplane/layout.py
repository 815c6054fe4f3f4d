"""Byte layout of one slot, shared by the planner and every backend.

A slot holds one offloaded chunk (`blocks_per_chunk` engine blocks of every KV tensor) for all
ranks: rank r owns bytes [r * shard_bytes, (r + 1) * shard_bytes). Inside a rank's shard, tensor
t's pages come one after another from `tensor_offsets[t]`, each `page_bytes[t]` long, so block j
of the chunk sits at `tensor_offsets[t] + j * page_bytes[t]` (vLLM's CPU layout, per rank).
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
    def tensor_offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for page in self.page_bytes:
            out.append(acc)
            acc += page * self.blocks_per_chunk
        return tuple(out)

    @property
    def shard_bytes(self) -> int:
        return sum(self.page_bytes) * self.blocks_per_chunk

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
