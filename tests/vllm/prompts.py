"""The prompts the vLLM tests feed the harness's engines, and the check on what a reader loaded:
BS tokens a block, seeded token prompts (any process builds the same one from its seed), and
that every block a reader took from kvd holds the bytes the writer's "model" computed for it.
Shared by the tests of this directory only (they need vLLM and tests/vllm/harness.py)."""

from __future__ import annotations

from typing import Any

import torch

BS = 16                       # tokens a block (the harness's block size)


def prompt(seed: int, n_tokens: int) -> list[int]:
    """`n_tokens` token ids drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 50000, (n_tokens,), generator=g).tolist()


def assert_loaded_bytes(reader: Any, tokens: list[int], hit_blocks: int) -> None:
    """Request "r" of `reader` (a tests/vllm/harness.py Engine) got its first `hit_blocks`
    blocks of `tokens` from kvd with the bytes their writer computed."""
    ids = reader.blocks_seen["r"]
    for i in range(hit_blocks):
        assert torch.equal(reader.kv[ids[i]], reader.expected_block(tokens, i)), f"block {i}"
