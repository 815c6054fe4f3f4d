"""What makes two vLLM engines share blocks: model, dtype, chunk geometry, shards, hashing."""

from __future__ import annotations

from vllm.v1.kv_offload.config import OffloadingConfig

from kvd_proto.wire import KvLayout

DEFAULT_KEY_BYTES = 40      # vLLM's offload key: a 32-byte block hash + a 4-byte group index


def layout_of(config: OffloadingConfig, key_bytes: int = DEFAULT_KEY_BYTES) -> KvLayout:
    """One slot = one chunk over all ranks (each rank's shard = its bytes per chunk)."""
    bpc = config.cache.blocks_per_chunk
    ranks = max(1, config.parallel.world_size)
    shard = config.worker_kv_bytes_per_block * bpc
    tokens = config.groups[0].tokens_per_block * bpc if config.groups else 0
    return KvLayout(block_bytes=shard * ranks, num_ranks=ranks, shard_bytes=shard,
                    tokens_per_block=tokens, dtype=str(config.model.dtype),
                    max_key_bytes=key_bytes)


def salt_of(config: OffloadingConfig) -> str:
    """Layout facts beyond bytes: hashing granularity and KV-group structure."""
    groups = ",".join(f"{g.tokens_per_block}:{g.sliding_window_size_in_chunks}"
                      for g in config.groups)
    return (f"vllm;tokens_per_hash={config.cache.tokens_per_hash};"
            f"bpc={config.cache.blocks_per_chunk};groups={groups};"
            f"layout={config.kv_cache_layout}")
