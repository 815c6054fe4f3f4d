"""The client's description of its namespace layout (what RegisterSession sends)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClientLayout:
    """One slot holds `num_ranks` shards of `shard_bytes`: block_bytes = num_ranks x shard."""

    block_bytes: int
    num_ranks: int
    shard_bytes: int
    tokens_per_block: int = 0
    dtype: str = ""

    def __post_init__(self) -> None:
        if self.num_ranks < 1 or self.shard_bytes < 1:
            raise ValueError("num_ranks and shard_bytes must be positive")
        if self.block_bytes != self.num_ranks * self.shard_bytes:
            raise ValueError(f"block_bytes {self.block_bytes} != num_ranks {self.num_ranks} x "
                             f"shard_bytes {self.shard_bytes}")
