"""An SGLang rank in a process of its own: kvd's backend over SGLang's real host pool.

`python -m tests.sglang.sgl_worker SOCKET ACTION LAYOUT PREFIX N SEED [UID]` builds an MHA host
pool in LAYOUT, creates the backend through SGLang's factory (the dynamic extra config), and:

- `store`: fills pages 1..N with SEED's bytes and backs them up (batch_set_v1), then waits
  until they all exist -> {"stored", "exists"};
- `read`: asks how many exist (batch_exists), reads them into pages N+1..2N (batch_get_v1) and
  compares with SEED's bytes -> {"exists", "got", "match"}.

With UID, everything is imported as root and the process drops to that uid before it talks
to the daemon (the daemon then sees another tenant through SO_PEERCRED). One JSON line out.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

from tests.support.sglang_env import install_stand_ins

install_stand_ins()

from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

import kvd_client.sglang.storage  # noqa: E402, F401  (imported before a uid drop)
from tests.support import sglang_env  # noqa: E402

WAIT_S = 10.0


def keys_for(prefix: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{prefix}/{i}".encode()).hexdigest() for i in range(n)]


def backend_for(sock: str, pool: object, extra: dict | None = None, **config: object) -> Any:
    """kvd's backend made by SGLang's factory from the dynamic extra config (plus `extra`),
    `config` overriding fields of the storage config, with `pool` registered."""
    storage = sglang_env.storage_config(extra_config={
        "backend_name": "kvd", "module_path": "kvd_client.sglang",
        "class_name": "KvdHiCacheStorage", "interface_v1": 1, "kvd_socket": sock,
        **(extra or {})}, **config)
    backend = StorageBackendFactory.create_backend("dynamic", storage, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def main(argv: list[str]) -> int:
    sock, action, layout, prefix, n_text, seed_text = argv[:6]
    n, seed = int(n_text), int(seed_text)
    pool = sglang_env.mha_host_pool(layout, pages=2 * n + 2)
    if len(argv) > 6:
        uid = int(argv[6])
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    backend = backend_for(sock, pool)
    backend._store.client.wait_available(WAIT_S)
    keys = keys_for(prefix, n)
    out: dict[str, object]
    if action == "store":
        sglang_env.fill_pages(pool, list(range(1, n + 1)), seed)
        stored = backend.batch_set_v1(keys, sglang_env.page_indices(pool, list(range(1, n + 1))))
        deadline = time.monotonic() + WAIT_S
        while backend.batch_exists(keys) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        out = {"stored": stored, "exists": backend.batch_exists(keys)}
    else:
        exists = backend.batch_exists(keys)
        pages = list(range(n + 1, 2 * n + 1))
        got = backend.batch_get_v1(keys, sglang_env.page_indices(pool, pages))
        match = [sglang_env.page_bytes(pool, p * pool.page_size)
                 == sglang_env.page_pattern(pool, i + 1, seed) for i, p in enumerate(pages)]
        out = {"exists": exists, "got": got, "match": match}
    backend.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
