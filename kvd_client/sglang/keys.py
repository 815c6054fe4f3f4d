"""SGLang's page keys as kvd keys.

SGLang names a page by a SHA-256 hash chain written as 64 lower-case hex characters
(`sglang/srt/mem_cache/utils.py` get_hash_str): deterministic across processes and restarts,
so two SGLang instances (and one instance after its restart) name a page alike. kvd keys are
bytes: such a key is stored as its 32 bytes (half the index width of its text). Any other
string (a backend of another scheme, a suffixed key) is hashed to 33 bytes (a marker byte and
its SHA-256), so it can never equal a 32-byte hex key.
"""

from __future__ import annotations

import hashlib

HEX_CHARS = 64
OTHER = b"\x01"


def page_key(key: str) -> bytes:
    if len(key) == HEX_CHARS:
        try:
            raw = bytes.fromhex(key)
        except ValueError:
            raw = b""
        if len(raw) == HEX_CHARS // 2:        # whitespace would have made it shorter
            return raw
    return OTHER + hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def page_keys(keys: list[str]) -> list[bytes]:
    return list(map(page_key, keys))
