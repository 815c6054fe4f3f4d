"""kvd as SGLang's HiCache storage backend (kvd_client/sglang): what SGLang's storage threads
pay for it, against a plain memcpy and SGLang's own file backend, in one run.

Everything is SGLang 0.5.23's own objects on CPU (tests/support/sglang_env.py): its MHA host
pool (`MHATokenToKVPoolHost`, bf16, 64-token pages, unpinned), kvd's backend made by SGLang's
`StorageBackendFactory` ("dynamic", with the default options and only `kvd_socket` set) over a
real `kvd serve` started with the defaults but `--pool-size` (pre-fault on, as a user gets it),
and SGLang's `HiCacheFile` on tmpfs (/dev/shm, removed afterwards).

- `exists`: `batch_exists` on 128 keys (SGLang's STORAGE_BATCH_SIZE) all present (`hit`: the
  answer is 128) and on 128 whose first key misses (`miss`: the answer is 0); microseconds per
  key (the call's time over 128), the median of REPEATS rounds of EXISTS_CALLS calls. The calls
  to the daemon made meanwhile on the calling thread (the backend's KvdClient `step` and
  `flush`, wrapped as bench/control_plane.py counts them) are reported: the answer comes from
  the mapped shared index, so the target is none.
- `cells`, per page size x host-pool layout (`page_first`, `layer_first`): a page is
  2 (K, V) x layers x 1 KV head x head_dim 128 x 2 bytes x 64 tokens, SGLang's shard of a TP-8
  rank: 8 layers (256 KiB), Llama-3.1-8B's 32 (1 MiB), Llama-3.1-70B's 80 (2.5 MiB). The host
  pool holds 256 pages; batches of 128 are written from its first half and read into its
  second. Each figure is the median of REPEATS timed calls after WARMUP untimed ones, in GB/s
  (1e9 bytes) of page bytes moved by the call:
  - `kvd`: `batch_set_v1` of 128 keys kvd does not hold yet (new keys every call: a held key
    is not copied again), and `batch_get_v1` of 128 held keys; SGLang's zero-copy calls
    (`_page_set_zero_copy` / `_page_get_zero_copy` in its cache_controller.py make just this
    call). Between two sets the bench waits (untimed) for the session's reserve of granted
    slots to hold 128 again, as the daemon refills it after the stores' evictions: the
    figure is one call's copy, not a sustained store stream. The warm-up sets cycle the whole
    daemon pool once, so every slot is mapped in this process before timing (a real engine's
    first pass over the pool pays its page faults once). Every page of one batch is checked
    byte for byte once (written, read back into other pages).
  - `memcpy`: numpy's copy of one contiguous buffer of the batch's bytes into another (both
    touched first): the bound a copy of those bytes meets on this machine.
  - `file`: `HiCacheFile` driven as SGLang's controller drives a backend without zero copy
    (`_generic_page_set`: `get_data_page(index)` flat per page, then `batch_set`;
    `_generic_page_get`: a dummy flat page per key, `batch_get`, then
    `set_from_flat_data_page` per page), the whole path timed; new keys every set (it skips a
    key whose file exists).
  Ratios `kvd_over_memcpy` and `kvd_over_file` (of GB/s), and `met` per cell: kvd's get and
  set each >= 0.8x memcpy and faster than the file backend (pages of 256 KiB and more).

kvd copies as a user's default backend does (kvd_client/sglang/pages.py through
kvd_client/dataplane/cpu.py's compiled copy, kvd_client/dataplane/_copy.c): non-temporal
stores, a batch shared among `kvd_copy_threads` threads (default: the CPUs the process may use,
up to 4; `copy_threads` in each cell). The same calls with one copy thread are reported beside
them (`one_thread`). memcpy is one thread; torch's copies in the file path use torch's own
intra-op threads, as SGLang's would.

Run: `python bench/sglang.py [--repeats N] [--layouts page_first,layer_first] [--no-record]`;
it writes `sglang` into bench/results/latest.json (the other keys kept); `make bench` runs it
through run_all.py.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
# This file is bench/sglang.py: with its folder first on sys.path (as `python bench/sglang.py`
# puts it), `import sglang` would import this file instead of SGLang. The folder goes last.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(ROOT))
sys.path.append(str(HERE))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)   # the bench picks the path

from tests.support.sglang_env import install_stand_ins  # noqa: E402

install_stand_ins()

import numpy as np  # noqa: E402
import torch  # noqa: E402

# (daemon and run_all are this folder's: run_all.py puts it first on sys.path again, but
# SGLang, imported by tests/support/sglang_env.py above, stays the package)
from daemon import start_daemon  # noqa: E402
from run_all import commit, machine  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvd_client.sglang.pages import PageGeometry  # noqa: E402
from tests.support import sglang_env as env  # noqa: E402
from tests.support.offload_engine import count_blocking_calls  # noqa: E402

BATCH = STORAGE_BATCH_SIZE                  # 128 pages a call, as SGLang's controller sends
PAGE_TOKENS = 64
HEAD_DIM = 128
HOST_PAGES = 2 * BATCH                      # sets from the first half, gets into the second
# (name, layers): one KV head a rank (TP 8), head_dim 128, bf16, 64-token pages
PAGE_SIZES = (("256KiB: 8 layers", 8), ("1MiB: Llama-3.1-8B TP8", 32),
              ("2.5MiB: Llama-3.1-70B TP8", 80))
LAYOUTS = ("page_first", "layer_first")
REPEATS = 7
WARMUP = 2
EXISTS_CALLS = 400
GOAL_MEMCPY = 0.8
GOAL_EXISTS_US = 1.0
REFILL_TIMEOUT_S = 10.0
POOL_MIN = 1 << 30                          # the daemon's default pool size
POOL_PAGES = 4 * HOST_PAGES                 # slots the pool holds at least


def page_bytes_of(layers: int) -> int:
    return 2 * layers * 1 * HEAD_DIM * 2 * PAGE_TOKENS


def pool_bytes(page_bytes: int) -> int:
    """The daemon's pool: its 1 GiB default, or 1,024 pages where that is more (a session's
    reserve of granted slots may take up to a quarter of the pool, and a 128-page store needs
    128 of them at once: kvd_client/offload/reserve.py)."""
    return max(POOL_MIN, POOL_PAGES * page_bytes)


def _keys(n: int) -> list[str]:
    """SGLang-like page keys: 64 hex characters (a SHA-256), new every call."""
    return [secrets.token_hex(32) for _ in range(n)]


def _timed(fn: Callable[[], Any], repeats: int, warmup: int = WARMUP) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _touch(pool: Any) -> None:
    """Fault in the whole host pool (SGLang's is pinned, so resident from the start)."""
    for name in ("kv_buffer", "k_buffer", "v_buffer"):
        buf = getattr(pool, name, None)
        if isinstance(buf, torch.Tensor):
            buf.view(torch.uint8).fill_(0x5A)


@contextlib.contextmanager
def _daemon(page_bytes: int) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvd-sgl-bench-", dir="/tmp") as work:
        proc, sock = start_daemon(work, str(pool_bytes(page_bytes)), prefault=True)
        try:
            yield sock
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _kvd_backend(pool: Any, sock: str) -> Any:
    extra = {"backend_name": "kvd", "module_path": "kvd_client.sglang",
             "class_name": "KvdHiCacheStorage", "interface_v1": 1, "kvd_socket": sock}
    be = StorageBackendFactory.create_backend("dynamic", env.storage_config(
        extra_config=extra, is_page_first_layout=pool.layout == "page_first"), pool)
    be.register_mem_pool_host(pool)
    be.on_host_pools_registered()
    if not be._store.client.wait_available(30):
        raise RuntimeError("kvd: the backend's client found no daemon")
    return be


def _reserve_slots(be: Any) -> int:
    return len(be._store.session._reserve)


def _wait(be: Any, probe: list[str], until: Callable[[], bool]) -> bool:
    """Step the session (an existence query applies the daemon's answers) until `until`."""
    deadline = time.monotonic() + REFILL_TIMEOUT_S
    while time.monotonic() < deadline:
        be.batch_exists(probe)
        if until():
            return True
        time.sleep(0.005)
    return False


def _exists(be: Any, held: list[str], repeats: int) -> dict:
    counted = count_blocking_calls(be._store.client)
    out: dict = {"keys_per_call": len(held), "calls_per_round": EXISTS_CALLS}
    for name, keys, want in (("hit", held, len(held)), ("miss", _keys(len(held)), 0)):
        got = be.batch_exists(keys)
        if got != want:
            raise RuntimeError(f"batch_exists answered {got} for the {name} batch, not {want}")
        per_key = []
        for _ in range(repeats + 1):             # the first round warms up
            t0 = time.perf_counter()
            for _ in range(EXISTS_CALLS):
                be.batch_exists(keys)
            per_key.append((time.perf_counter() - t0) / EXISTS_CALLS / len(keys) * 1e6)
        out[f"{name}_us_per_key"] = statistics.median(per_key[1:])
        out[f"{name}_us_per_call"] = out[f"{name}_us_per_key"] * len(keys)
    out["daemon_calls"] = counted[0]
    return out


def _kvd(pool: Any, sock: str, page_bytes: int, repeats: int) -> dict:
    """kvd's v1 set and get (see the module doc), byte-exact once; also `exists`."""
    src = env.page_indices(pool, list(range(BATCH)))
    dst = env.page_indices(pool, list(range(BATCH, 2 * BATCH)))
    written = env.fill_pages(pool, list(range(BATCH)), seed=11)
    be = _kvd_backend(pool, sock)
    try:
        probe = _keys(1)
        if not _wait(be, probe, lambda: be._store.session.capacity > 0):
            raise RuntimeError("kvd: the session has no index")
        slots = be._store.session.capacity
        set_s: list[float] = []
        refused = refill_timeouts = 0
        warm = max(WARMUP, -(-slots // BATCH) + 1)       # cycle the pool's slots once
        last: list[str] = []
        for i in range(warm + repeats):
            if not _wait(be, probe, lambda: _reserve_slots(be) >= BATCH):
                refill_timeouts += 1
            keys = _keys(BATCH)
            t0 = time.perf_counter()
            ok = be.batch_set_v1(keys, src)
            dt = time.perf_counter() - t0
            if not all(ok):
                refused += 1
                continue
            last = keys
            if i >= warm:
                set_s.append(dt)
        if not last or not _wait(be, probe, lambda: be.batch_exists(last) == BATCH):
            raise RuntimeError(f"kvd held none of the last batch ({refused} sets refused)")
        got = be.batch_get_v1(last, dst)
        exact = all(got) and all(env.page_bytes(pool, (BATCH + i) * PAGE_TOKENS) == written[i]
                                 for i in range(BATCH))
        get_s = _timed(lambda: be.batch_get_v1(last, dst), repeats)
        exists = _exists(be, last, repeats)       # before the sets below evict `last`
        threads = be._geometry.copy_threads
        # The same calls with the copy in one thread (kvd_copy_threads 1), for comparison.
        be._geometry = dataclasses.replace(be._geometry, copy_threads=1)
        get1_s = _timed(lambda: be.batch_get_v1(last, dst), repeats)
        set1_s: list[float] = []
        for _ in range(repeats):
            _wait(be, probe, lambda: _reserve_slots(be) >= BATCH)
            t0 = time.perf_counter()
            ok = be.batch_set_v1(_keys(BATCH), src)
            if all(ok):
                set1_s.append(time.perf_counter() - t0)
        failures = be._store.counters.failures
    finally:
        be.close()
    nbytes = BATCH * page_bytes
    return {"set_gb_per_s": _gbps(nbytes, set_s) if set_s else 0.0,
            "get_gb_per_s": _gbps(nbytes, get_s), "set_seconds": set_s, "get_seconds": get_s,
            "copy_threads": threads,
            "one_thread": {"get_gb_per_s": _gbps(nbytes, get1_s),
                           "set_gb_per_s": _gbps(nbytes, set1_s) if set1_s else 0.0},
            "pool_slots": slots, "warmup_sets": warm, "sets_refused": refused,
            "reserve_refill_timeouts": refill_timeouts, "copy_failures": failures,
            "byte_exact": exact, "exists": exists}


def _file(pool: Any, page_bytes: int, repeats: int) -> dict:
    """SGLang's HiCacheFile on tmpfs through the controller's non-zero-copy paths."""
    base = tempfile.mkdtemp(prefix="kvd-sgl-bench-file-", dir="/dev/shm")
    try:
        cfg = env.storage_config(extra_config={"file_storage_path": base},
                                 is_page_first_layout=pool.layout == "page_first")
        fb = StorageBackendFactory.create_backend("file", cfg, pool)
        fb.register_mem_pool_host(pool)
        ps = pool.page_size
        src = env.page_indices(pool, list(range(BATCH)))
        dst = env.page_indices(pool, list(range(BATCH, 2 * BATCH)))
        written: list[list[str]] = []

        def page_set() -> None:        # cache_controller._generic_page_set
            keys = _keys(BATCH)
            data = [pool.get_data_page(src[i * ps]) for i in range(len(keys))]
            if not fb.batch_set(keys, data):
                raise RuntimeError("HiCacheFile refused a batch_set")
            written.append(keys)

        def page_get() -> None:        # cache_controller._generic_page_get
            keys = written[-1]
            dummy = [pool.get_dummy_flat_data_page() for _ in keys]
            data = fb.batch_get(keys, dummy)
            for i in range(len(keys)):
                if data[i] is None:
                    raise RuntimeError("HiCacheFile missed a page it wrote")
                pool.set_from_flat_data_page(dst[i * ps], data[i])

        set_s = []
        for i in range(WARMUP + repeats):
            t0 = time.perf_counter()
            page_set()
            if i >= WARMUP:
                set_s.append(time.perf_counter() - t0)
            for old in written[:-1]:                   # untimed: keep tmpfs to one batch
                for key in old:
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(base, f"{fb._get_suffixed_key(key)}.bin"))
            del written[:-1]
        get_s = _timed(page_get, repeats)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    nbytes = BATCH * page_bytes
    return {"set_gb_per_s": _gbps(nbytes, set_s), "get_gb_per_s": _gbps(nbytes, get_s),
            "set_seconds": set_s, "get_seconds": get_s, "directory": "/dev/shm (tmpfs)"}


def _memcpy(nbytes: int, page_bytes: int, repeats: int) -> dict:
    a = np.full(nbytes, 0x5A, dtype=np.uint8)
    b = np.zeros(nbytes, dtype=np.uint8)
    src, dst = a.ctypes.data, b.ctypes.data
    seconds = _timed(lambda: np.copyto(b, a), repeats)

    def per_page() -> None:
        for offset in range(0, nbytes, page_bytes):
            ctypes.memmove(dst + offset, src + offset, page_bytes)

    # the same bytes as one memmove per page: glibc's memcpy streams (non-temporal stores)
    # only above its x86_non_temporal_threshold, which one batch may cross and a page not
    paged = _timed(per_page, repeats)
    return {"gb_per_s": _gbps(nbytes, seconds), "seconds": seconds,
            "per_page_gb_per_s": _gbps(nbytes, paged), "per_page_seconds": paged}


def _glibc_non_temporal_threshold() -> int | None:
    """glibc's x86_non_temporal_threshold (bytes) in this environment, where it can be read:
    memcpy uses non-temporal stores above it."""
    for loader in ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1"):
        try:
            r = subprocess.run([loader, "--list-tunables"], capture_output=True, text=True,
                               timeout=10)
        except OSError:
            continue
        for line in r.stdout.splitlines():
            if "non_temporal_threshold" in line:
                return int(line.split(":", 1)[1].split()[0], 0)
    return None


def cell(name: str, layers: int, layout: str, repeats: int) -> dict:
    page_bytes = page_bytes_of(layers)
    nbytes = BATCH * page_bytes
    pool = env.mha_host_pool(layout, layers=layers, heads=1, head_dim=HEAD_DIM,
                             page_size=PAGE_TOKENS, pages=HOST_PAGES, dtype=torch.bfloat16)
    _touch(pool)
    with _daemon(page_bytes) as sock:
        kvd = _kvd(pool, sock, page_bytes, repeats)
    g = PageGeometry.probe(pool)
    geometry_runs = {"runs_per_page": int(g.bases.size), "run_bytes": g.run_bytes}
    memcpy = _memcpy(nbytes, page_bytes, repeats)
    file = _file(pool, page_bytes, repeats)
    del pool
    exists = kvd.pop("exists")
    ratios = {way: {"kvd_over_memcpy": kvd[f"{way}_gb_per_s"] / memcpy["gb_per_s"],
                    "kvd_over_memcpy_per_page": kvd[f"{way}_gb_per_s"]
                    / memcpy["per_page_gb_per_s"],
                    "kvd_over_file": kvd[f"{way}_gb_per_s"] / file[f"{way}_gb_per_s"]}
              for way in ("get", "set")}
    met = {}
    for way in ("get", "set"):
        met[f"{way}_ge_{GOAL_MEMCPY}x_memcpy"] = ratios[way]["kvd_over_memcpy"] >= GOAL_MEMCPY
        met[f"{way}_faster_than_file"] = ratios[way]["kvd_over_file"] > 1.0
    met["byte_exact"] = kvd["byte_exact"]
    return {"page": name, "layers": layers, "kv_heads": 1, "head_dim": HEAD_DIM,
            "page_tokens": PAGE_TOKENS, "dtype": "bfloat16", "layout": layout,
            "page_bytes": page_bytes, "batch_pages": BATCH, "batch_bytes": nbytes,
            "daemon_pool_bytes": pool_bytes(page_bytes), **geometry_runs,
            "kvd": kvd, "memcpy": memcpy, "file": file, **ratios, "met": met,
            "exists": exists}


def run(repeats: int = REPEATS, layouts: tuple[str, ...] = LAYOUTS,
        log: Callable[[str], None] = print) -> dict:
    t0 = time.time()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    load0 = os.getloadavg()
    cells = []
    for layout in layouts:
        for name, layers in PAGE_SIZES:
            c = cell(name, layers, layout, repeats)
            cells.append(c)
            log(f"{layout:11s} {name:27s} get kvd {c['kvd']['get_gb_per_s']:5.2f} "
                f"file {c['file']['get_gb_per_s']:5.2f} | set kvd {c['kvd']['set_gb_per_s']:5.2f} "
                f"file {c['file']['set_gb_per_s']:5.2f} (one copy thread: get "
                f"{c['kvd']['one_thread']['get_gb_per_s']:5.2f} set "
                f"{c['kvd']['one_thread']['set_gb_per_s']:5.2f}) | memcpy {c['memcpy']['gb_per_s']:5.2f} "
                f"(per page {c['memcpy']['per_page_gb_per_s']:5.2f}) GB/s | exists hit {c['exists']['hit_us_per_key']:.3f} miss "
                f"{c['exists']['miss_us_per_key']:.3f} us/key")
    exists = {k: max(c["exists"][k] for c in cells)
              for k in ("hit_us_per_key", "miss_us_per_key", "daemon_calls")}
    exists["measure"] = (f"worst of the cells; batches of {BATCH} keys, median of {repeats} "
                         f"rounds of {EXISTS_CALLS} calls")
    met = {
        f"exists_hit_le_{GOAL_EXISTS_US:g}us_per_key": exists["hit_us_per_key"] <= GOAL_EXISTS_US,
        f"exists_miss_le_{GOAL_EXISTS_US:g}us_per_key":
            exists["miss_us_per_key"] <= GOAL_EXISTS_US,
        "exists_no_daemon_calls": exists["daemon_calls"] == 0,
    }
    for layout in layouts:
        mine = [c for c in cells if c["layout"] == layout]
        for key in mine[0]["met"]:
            met[f"{layout}_{key}"] = all(c["met"][key] for c in mine)
    return {"machine": machine(), "commit": commit(), "started": started,
            "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "load_average": {"started": load0, "finished": os.getloadavg()},
            "glibc_non_temporal_threshold": _glibc_non_temporal_threshold(),
            "sglang_version": _sglang_version(), "torch_threads": torch.get_num_threads(),
            "repeats": repeats, "warmup": WARMUP, "batch_pages": BATCH,
            "exists": exists, "cells": cells, "met": met, "elapsed_seconds": time.time() - t0}


def _sglang_version() -> str:
    import sglang

    return str(getattr(sglang, "__version__", ""))


def record(result: dict) -> None:
    """`result` as `sglang` of results/latest.json, every other key kept."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "latest.json"
    latest = json.loads(path.read_text()) if path.exists() else {}
    latest["sglang"] = result
    path.write_text(json.dumps(latest, indent=2) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=REPEATS, help="timed calls a figure")
    ap.add_argument("--layouts", default=",".join(LAYOUTS),
                    help="host pool layouts, comma-separated")
    ap.add_argument("--no-record", action="store_true",
                    help="print the results only (latest.json untouched)")
    args, _ = ap.parse_known_args()     # make bench passes run_all.py's BENCH_ARGS too
    result = run(args.repeats, tuple(args.layouts.split(",")),
                 log=lambda m: print(m, file=sys.stderr, flush=True))
    if not args.no_record:
        record(result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
