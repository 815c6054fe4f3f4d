"""Write a config-only Hugging Face cache entry for the model our vLLM conformance tests name.

vLLM's ModelConfig reads the model's config.json even when no weights are loaded; the tests
run with HF_HUB_OFFLINE=1, so the entry must be in the local cache. Idempotent; honours HF_HOME.
"""

from __future__ import annotations

import os
import sys

MODEL = "facebook/opt-125m"
REVISION = "0" * 40


def main() -> int:
    from transformers import OPTConfig

    home = os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface"))
    base = os.path.join(home, "hub", "models--" + MODEL.replace("/", "--"))
    snapshot = os.path.join(base, "snapshots", REVISION)
    if os.path.exists(os.path.join(snapshot, "config.json")):
        print(f"{MODEL}: config already cached at {snapshot}")
        return 0
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(base, "refs"), exist_ok=True)
    with open(os.path.join(base, "refs", "main"), "w") as f:
        f.write(REVISION)
    cfg = OPTConfig(hidden_size=768, num_attention_heads=12, num_hidden_layers=12, ffn_dim=3072,
                    vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=768,
                    torch_dtype="float16")
    cfg.architectures = ["OPTForCausalLM"]
    cfg.save_pretrained(snapshot)
    print(f"{MODEL}: wrote config-only cache entry at {snapshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
