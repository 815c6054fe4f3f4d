"""Which kvd namespace an SGLang rank's pages belong to, from SGLang's own configuration.

Two SGLang instances share pages exactly when their bytes mean the same thing: the same model,
the same page size and dtype, the same host-pool layout (a page is stored as the host pool
lays it out: `layer_first`, `page_first` and `page_first_direct` order its bytes differently),
and the same shard of the KV heads. So the namespace is scoped by all of them:

- MHA: each tensor-parallel rank holds its own heads, runs its own HiCache controller and backs
  up its own pages, so every (tp_size, tp_rank) is a namespace of its own (one slot is one
  rank's page). Shards of one slot, as vLLM's workers write them, would need the ranks to agree
  on a slot before any of them writes, a round trip between SGLang's ranks that its storage
  interface does not have; apart, each rank's backend is independent and two instances of one
  model at one TP size share every rank's pages.
- MLA (`is_mla_model`: pages identical on every rank): one namespace for every rank, written by
  SGLang's one storage writer and read by all (SGLang takes the minimum hit over its ranks, so
  a page keyed by rank would hit on one rank only).
- Pipeline stages, attention context-parallel and decode context-parallel shards hold different
  layers or tokens: each is scoped, as SGLang's own file backend scopes its files.

The salt starts with "sglang;", so a vLLM engine on the same daemon (its salt starts with
"vllm;") shares the pool's memory but never a block. `kvd_namespace` adds a scope of the
operator's (tenants apart on one uid); the daemon keeps uids apart by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvd_proto.wire import KvLayout

KEY_BYTES = 40          # SGLang's keys are SHA-256 hex (32 bytes), others hashed to 33


@dataclass(frozen=True, slots=True)
class Namespace:
    model: str
    salt: str
    layout: KvLayout


def namespace_of(config: Any, *, page_size: int, page_bytes: int, pool_layout: str,
                 dtype: str, model: str = "", scope: str = "") -> Namespace:
    """The namespace of this rank's pages. `config` is SGLang's HiCacheStorageConfig (read by
    attribute: sglang/srt/mem_cache/hicache_storage.py defines its fields)."""
    mla = bool(getattr(config, "is_mla_model", False))
    parts = ["sglang", "mla" if mla else "mha", f"page={page_size}", f"layout={pool_layout}",
             f"dtype={dtype}"]
    if not mla:
        parts.append(f"tp={config.tp_size}:{config.tp_rank}")
    if getattr(config, "pp_size", 1) > 1:
        parts.append(f"pp={config.pp_size}:{config.pp_rank}")
    if getattr(config, "attn_cp_size", 1) > 1:
        parts.append(f"cp={config.attn_cp_size}:{config.attn_cp_rank}")
    if getattr(config, "dcp_size", 1) > 1:
        parts.append(f"dcp={config.dcp_size}:{config.dcp_rank}:tp{config.tp_size}"
                     f":page{config.logical_page_size}")
    if scope:
        parts.append(f"scope={scope}")
    name = model or str(getattr(config, "model_name", "") or "") or "unnamed-model"
    layout = KvLayout(block_bytes=page_bytes, num_ranks=1, shard_bytes=page_bytes,
                      tokens_per_block=page_size, dtype=dtype, max_key_bytes=KEY_BYTES)
    return Namespace(model=name, salt=";".join(parts), layout=layout)
