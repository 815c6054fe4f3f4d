"""The cluster tier (kvd_server/tiers/cluster/tier.py) on a real Mooncake store: two daemons on one
master on loopback, against Mooncake's own put/get in the same run, every daemon with the
defaults a user gets except the pool's size and `[tiers.cluster]`'s master and segment.

- `bandwidth`, per block size (256 KiB, 2 MiB):
  - `mooncake`: a store client of its own (no segment) puts N blocks into the daemons'
    segments and gets them back, from IO_THREADS threads (the tier's default depth); GB/s.
  - `publication`: an engine on daemon A stores the N blocks (publish = "stored"): bytes over
    the time from the first store until A's tier has put them all (`demotions_total`, queue
    empty); as a fraction of Mooncake's put.
  - `promotion`: an engine on daemon B reads them back as a scheduler does (its first lookup
    asks the store, then HIT_PENDING, step, again until HIT; a quarter pool a batch): bytes
    over the time from the first lookup to the last HIT; as a fraction of Mooncake's get (the
    issue's goal: >= 0.8x).
- `hit_rate`: bench/tiers.py's chat trace replayed through two engines, one per daemon, each
  request sent to one of them at random (seeded: sessions move between nodes), arriving at
  20 requests/s (HR_PACE_S), against two daemons with no tier, then two on one store (blocks
  found on demand, the user's defaults): hit blocks and the gain.

Run: `python bench/cluster_tier.py [--quick]` (needs `pip install 'kvd-offload[cluster]'` and Debian's
libibverbs1 librdmacm1); it writes `cluster_tier` into bench/results/latest.json and its
section of bench/README.md. `make bench` runs it after bench/tiers.py.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from run_all import commit, machine  # noqa: E402
from tiers import (  # noqa: E402
    HR_BLOCK,
    HR_POOL_MIB,
    HR_TOKENS_PER_BLOCK,
    HR_TRACE,
    HR_TRACE_QUICK,
    IO_THREADS,
    MIB,
    Daemon,
    close_session,
    keys_for,
    open_session,
    read_back,
    record,
    replay,
    store,
)
from traces import block_keys, generate  # noqa: E402

from tests.support import mooncake  # noqa: E402

SIZES = (256 << 10, 2 << 20)
BW_POOL_MIB = 256
BW_BLOCKS_MIB = 128            # bytes moved per size (--quick: 32)
SEGMENT_MIB = 512              # each daemon's segment: the store holds both runs
HR_SEED = 7
# Requests arrive at 20/s across the two nodes (a replay at full speed would take the whole
# trace in under a second, before any node could hear of another's blocks: a real turn of a
# conversation comes seconds after the previous one, each answer taking its decode time).
HR_PACE_S = 0.05
GOAL = 0.8


def _toml(master: mooncake.Master, node: str) -> str:
    return (f'[tiers.cluster]\nmaster = "{master.address}"\n'
            f'metadata_url = "{master.metadata_url}"\nlocal_hostname = "127.0.0.1"\n'
            f'segment_size = "{SEGMENT_MIB}MiB"\nnode_id = "{node}"\n')


def raw(master: mooncake.Master, block: int, n: int) -> dict:
    """Mooncake's own put and get of n blocks from IO_THREADS threads (see the module doc)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup("127.0.0.1", master.metadata_url, 0, 64 * MIB, "tcp", "",
                      master.address)
    if rc:
        raise RuntimeError(f"Mooncake setup failed: {rc}")
    value = bytes(range(256)) * (block // 256)
    names = [f"bench/raw/{block}/{i}" for i in range(n)]
    try:
        with ThreadPoolExecutor(IO_THREADS) as pool:
            t0 = time.perf_counter()
            codes = list(pool.map(lambda name: client.put(name, value), names))
            put_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = list(pool.map(client.get, names))
            get_s = time.perf_counter() - t0
        if any(codes) or any(len(g) != block for g in got):
            raise RuntimeError(f"raw put/get failed: codes {set(codes)}")
        return {"put_gb_per_s": n * block / put_s / 1e9, "get_gb_per_s": n * block / get_s / 1e9,
                "blocks": n}
    finally:
        client.remove_by_regex("^bench/raw/")
        client.close()


def shared(a: Daemon, b: Daemon, block: int, n: int) -> dict:
    """A's engine stores n blocks (published); B's reads them back (see the module doc)."""
    writer = open_session(a.socket, block, f"bench-cluster-{block}")
    reader = open_session(b.socket, block, f"bench-cluster-{block}")
    try:
        keys = keys_for(f"cluster-{block}", n)
        payload = bytes(range(256)) * (block // 256)
        before = a.tier()
        batch = max(1, min(64, writer.capacity // 8))
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            if not store(writer, keys[i:i + batch], payload):
                raise RuntimeError("the reserve stayed short")
        a.wait(lambda: a.tier()["demotions_total"] - before["demotions_total"] >= n
               and a.tier()["queue_depth"] == 0, "the publications", poll=0.005)
        pub_s = time.perf_counter() - t0
        before_b = b.tier()
        per = max(1, reader.capacity // 4)
        states = {"hit": 0, "miss": 0, "pending_given_up": 0}
        t0 = time.perf_counter()
        for i in range(0, n, per):
            got, _ = read_back(reader, keys[i:i + per])
            for k, v in got.items():
                states[k] += v
        pro_s = time.perf_counter() - t0
        after_b = b.tier()
        promoted = after_b["promoted_bytes_total"] - before_b["promoted_bytes_total"]
        return {"publication_gb_per_s": n * block / pub_s / 1e9,
                "promotion_gb_per_s": promoted / pro_s / 1e9, **states,
                "promotions": after_b["promotions_total"] - before_b["promotions_total"]}
    finally:
        close_session(writer)
        close_session(reader)


def bandwidth(base: Path, master: mooncake.Master, quick: bool) -> list[dict]:
    rows = []
    moved = (32 if quick else BW_BLOCKS_MIB) * MIB
    for block in SIZES:          # fresh daemons per size: the pools' extents are not shared
        n = moved // block
        a = Daemon(base / f"bw-a-{block}", BW_POOL_MIB, toml=_toml(master, f"a-{block}"))
        b = Daemon(base / f"bw-b-{block}", BW_POOL_MIB, toml=_toml(master, f"b-{block}"))
        try:
            r = {"block_bytes": block, "raw": raw(master, block, n), **shared(a, b, block, n)}
            r["publication_of_put"] = r["publication_gb_per_s"] / r["raw"]["put_gb_per_s"]
            r["promotion_of_get"] = r["promotion_gb_per_s"] / r["raw"]["get_gb_per_s"]
        finally:
            a.close()
            b.close()
        rows.append(r)
        print(f"{block >> 10} KiB: mooncake put {r['raw']['put_gb_per_s']:.2f} get "
              f"{r['raw']['get_gb_per_s']:.2f} GB/s | publication "
              f"{r['publication_gb_per_s']:.2f} ({r['publication_of_put']:.0%}) | "
              f"promotion {r['promotion_gb_per_s']:.2f} ({r['promotion_of_get']:.0%}), "
              f"{r['miss']} miss", flush=True)
    return rows


def hit_rate(base: Path, master: mooncake.Master, quick: bool) -> dict:
    shape, size = HR_TRACE_QUICK if quick else HR_TRACE
    requests = [list(block_keys(r.tokens, HR_TOKENS_PER_BLOCK)) for r in generate(shape, size)]
    rng = random.Random(HR_SEED)
    picks = [rng.randrange(2) for _ in requests]
    out: dict = {"trace": f"{shape}/{size}", "requests": len(requests),
                 "block_bytes": HR_BLOCK, "pool_bytes_each": HR_POOL_MIB * MIB}
    for name in ("no_tier", "cluster"):
        daemons = [Daemon(base / f"hr-{name}-{i}", HR_POOL_MIB,
                          toml=_toml(master, f"hr-{i}") if name == "cluster" else "")
                   for i in range(2)]
        sessions = []
        try:
            sessions = [open_session(d.socket, HR_BLOCK, "bench-cluster-chat") for d in daemons]
            out[name] = replay(sessions, requests, picks.__getitem__, HR_PACE_S)
        finally:
            for s in sessions:
                close_session(s)
            for d in daemons:
                d.close()
        print(f"hit rate {name}: {out[name]['hit_blocks']} of {out[name]['lookup_blocks']} "
              f"({out[name]['hit_rate']:.1%})", flush=True)
    out["gain"] = out["cluster"]["hit_blocks"] / max(1, out["no_tier"]["hit_blocks"])
    return out


def run(base: Path, quick: bool) -> dict:
    master = mooncake.Master(base)
    master.start()
    try:
        out = {"machine": machine(), "commit": commit(), "quick": quick,
               "io_threads": IO_THREADS, "bandwidth": bandwidth(base, master, quick),
               "hit_rate": hit_rate(base, master, quick)}
    finally:
        master.stop()
    worst = min(r["promotion_of_get"] for r in out["bandwidth"])
    out["targets"] = {f"promotion across daemons >= {GOAL:.0%} of Mooncake's get": worst >= GOAL,
                      "hits gain when sessions move between daemons": out["hit_rate"]["gain"] > 1}
    return out


def table(t: dict) -> str:
    m, hr = t["machine"], t["hit_rate"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores. Commit: `{t['commit']}`. One Mooncake "
             f"master and two daemons on loopback (TCP), {t['io_threads']} threads each side.",
             "", "| block | Mooncake put / get GB/s | publication GB/s (of put) | promotion "
             "across daemons GB/s (of get) | read back MISS |", "|---|---|---|---|---|"]
    for r in t["bandwidth"]:
        lines.append(f"| {r['block_bytes'] >> 10} KiB | {r['raw']['put_gb_per_s']:.2f} / "
                     f"{r['raw']['get_gb_per_s']:.2f} | {r['publication_gb_per_s']:.2f} "
                     f"({r['publication_of_put']:.0%}) | {r['promotion_gb_per_s']:.2f} "
                     f"({r['promotion_of_get']:.0%}) | {r['miss']} |")
    nt, cl = hr["no_tier"], hr["cluster"]
    lines += ["", f"Hits, {hr['trace']} ({hr['requests']} requests, each sent to one of two "
              f"daemons at random), pool {hr['pool_bytes_each'] // MIB} MiB each: "
              f"{nt['hit_blocks']} of {nt['lookup_blocks']} blocks hit without a tier "
              f"({nt['hit_rate']:.1%}), {cl['hit_blocks']} with the cluster tier "
              f"({cl['hit_rate']:.1%}): **{hr['gain']:.2f}x**.", "", "| target | |",
              "|---|---|"]
    lines += [f"| {n} | {'met' if ok else '**missed**'} |" for n, ok in t["targets"].items()]
    return "\n".join(lines) + "\n"


def cluster_main(doc: str, script: str, key: str, marker: str, quick_help: str,
                 run_in: Callable[[Path, bool], dict], table_of: Callable[[dict], str]) -> int:
    """A cluster bench's command line: skipped (said) without Mooncake; the run in a
    temporary directory; recorded as `key` of latest.json (and bench/results/KEY_COMMIT.json)
    and between bench/README.md's `marker` lines, unless --no-record."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--no-record", action="store_true", help="print the results only")
    args, _ = ap.parse_known_args()
    why = mooncake.unavailable()
    if why:
        print(f"{script} skipped: {why}")
        return 0
    with tempfile.TemporaryDirectory(prefix="kvd-cl-", dir="/tmp") as tmp:
        result = run_in(Path(tmp), args.quick)
    if not args.no_record:
        (HERE / "results").mkdir(exist_ok=True)
        (HERE / "results" / f"{key}_{result['commit']}.json").write_text(
            json.dumps(result, indent=2) + "\n")
        record(result, key, table_of(result), marker)
    print(table_of(result))
    return 0


def main() -> int:
    return cluster_main(__doc__, "bench/cluster_tier.py", "cluster_tier", "cluster-results",
                        "a smaller run", run, table)



if __name__ == "__main__":
    sys.exit(main())
