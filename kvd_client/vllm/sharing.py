"""What makes two vLLM engines share blocks: model, dtype, chunk geometry, shards, hashing."""

from __future__ import annotations

from vllm.v1.kv_offload.config import OffloadingConfig

from kvd_proto.wire import KvLayout

DEFAULT_KEY_BYTES = 40      # vLLM's offload key: a 32-byte block hash + a 4-byte group index

def is_replicated(config: OffloadingConfig) -> bool:
    """Every rank holds the same KV bytes (MLA under tensor parallelism, as vLLM decides it):
    a slot holds one copy, rank 0 writes it, every rank reads it.

    vLLM's canonical layout rotates writers per block instead; kvd does not implement it and
    keeps one shard per rank there (correct, just larger).
    """
    return config.replicated_layout and not config.canonical_layout


def layout_of(config: OffloadingConfig, key_bytes: int = DEFAULT_KEY_BYTES) -> KvLayout:
    """One slot = one chunk over all ranks (each rank's shard = its bytes per chunk); one
    shard in all when the ranks' KV is replicated."""
    bpc = config.cache.blocks_per_chunk
    ranks = 1 if is_replicated(config) else max(1, config.parallel.world_size)
    shard = config.worker_kv_bytes_per_block * bpc
    tokens = config.groups[0].tokens_per_block * bpc if config.groups else 0
    return KvLayout(block_bytes=shard * ranks, num_ranks=ranks, shard_bytes=shard,
                    tokens_per_block=tokens, dtype=str(config.model.dtype),
                    max_key_bytes=key_bytes)


def salt_of(config: OffloadingConfig) -> str:
    """Layout facts beyond bytes: hashing granularity, KV-group structure, and whether the
    one shard is a replicated copy (so a TP-1 engine never shares slots with a replicated
    TP-8 one, whose bytes per block may coincide)."""
    groups = ",".join(f"{g.tokens_per_block}:{g.sliding_window_size_in_chunks}"
                      for g in config.groups)
    salt = (f"vllm;tokens_per_hash={config.cache.tokens_per_hash};"
            f"bpc={config.cache.blocks_per_chunk};groups={groups};"
            f"layout={config.kv_cache_layout}")
    return salt + ";replicated" if is_replicated(config) else salt
