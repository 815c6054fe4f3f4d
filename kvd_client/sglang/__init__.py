"""kvd as SGLang's HiCache storage backend (docs/sglang.md).

SGLang loads it by module path: `"module_path": "kvd_client.sglang", "class_name":
"KvdHiCacheStorage"` in `--hicache-storage-backend-extra-config`. Importing this package
imports SGLang and torch (the backend subclasses SGLang's HiCacheStorage); the parts that do
not need them (options, identity, keys, pager, pages) import on their own.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvdHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KvdHiCacheStorage":
        from kvd_client.sglang.storage import KvdHiCacheStorage

        return KvdHiCacheStorage
    raise AttributeError(name)
