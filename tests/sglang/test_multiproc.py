"""kvd's SGLang backend across processes: two SGLang-side processes share a prefix through
one daemon, a vLLM-side session and an SGLang backend share one pool but no block, and another
uid's SGLang never reads the first tenant's pages (each rank a process of its own,
tests/sglang/sgl_worker.py, over SGLang's real host pool and factory)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from kvd_client.client import KvdClient
from kvd_client.offload.session import Lookup, OffloadSession
from tests.sglang.sgl_worker import backend_for, keys_for
from tests.support import sglang_env as E
from tests.support.daemon import PY, ROOT, clean_env, spawn_daemon

pytestmark = pytest.mark.multiproc


def worker(sock: str, *args: str) -> dict:
    out = subprocess.run([PY, "-m", "tests.sglang.sgl_worker", sock, *args], env=clean_env(),
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_two_sglang_processes_share_a_prefix_byte_exact(daemon, layout):
    wrote = worker(daemon.socket, "store", layout, "shared-prefix", "8", "11")
    assert wrote == {"stored": [True] * 8, "exists": 8}
    read = worker(daemon.socket, "read", layout, "shared-prefix", "8", "11")
    assert read["exists"] == 8 and read["got"] == [True] * 8 and all(read["match"])
    # A different layout is a different namespace: its pages would be garbage there.
    other = "page_first_direct"
    assert worker(daemon.socket, "read", other, "shared-prefix", "8", "11")["exists"] == 0


def test_vllm_and_sglang_share_the_pool_never_a_block(daemon):
    """A session as vLLM's plug-in opens it (same model, same block bytes, a salt that starts
    with "vllm;") and SGLang's backend store the same key bytes: one pool, two namespaces,
    each engine reads only its own blocks."""
    pool = E.mha_host_pool("page_first")
    backend = backend_for(daemon.socket, pool)
    keys = keys_for("both-engines", 4)
    raw = [bytes.fromhex(k) for k in keys]
    sgl_layout = backend._store.client.layout
    client = KvdClient(daemon.socket, model="test/model", layout=sgl_layout,
                       salt="vllm;tokens_per_hash=4;bpc=1;groups=4:0;layout=NHD",
                       engine_kind="vllm", deadline_s=0.5)
    session = OffloadSession(client, reserve=16)
    try:
        assert backend._store.client.wait_available(10) and client.wait_available(10)
        E.fill_pages(pool, [1, 2, 3, 4], seed=2)
        assert backend.batch_set_v1(keys, E.page_indices(pool, [1, 2, 3, 4])) == [True] * 4
        deadline = time.monotonic() + 10
        while backend.batch_exists(keys) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backend.batch_exists(keys) == 4
        assert [session.lookup(k) for k in raw] == [Lookup.MISS] * 4    # not vLLM's
        session.end_step()
        # vLLM's own blocks under the same keys: stored, readable by vLLM only.
        granted = session.reserve(raw[:2], req_id="v")
        assert granted and len(granted) == 2
        session.complete_store([k for k, _ in granted], req_id="v")
        session.end_step()
        while session.has_pending_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [session.lookup(k) for k in raw[:2]] == [Lookup.HIT] * 2
        session.end_step()
        assert client.pool_id == backend._store.client.pool_id              # one pool
        assert client.namespace_id != backend._store.client.namespace_id
        # SGLang's pages are still SGLang's bytes.
        assert backend.batch_get_v1(keys, E.page_indices(pool, [5, 6, 7, 8])) == [True] * 4
        for page, source in zip([5, 6, 7, 8], [1, 2, 3, 4], strict=True):
            assert E.page_bytes(pool, page * pool.page_size) == E.page_pattern(pool, source, 2)
    finally:
        session.close()
        client.close()
        backend.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_another_uids_sglang_never_reads_the_first_tenants_pages(workdir: Path):
    os.chmod(workdir, 0o755)
    sockdir = workdir / "s"
    sockdir.mkdir()
    os.chmod(sockdir, 0o777)
    env = clean_env(KVD_SERVER_SOCKET_MODE="0666", KVD_MANAGER_HEARTBEAT_INTERVAL="200ms",
                    KVD_MANAGER_LIVENESS_TIMEOUT="1s", KVD_TENANTS_UIDS="60011=team-x,60012=team-y",
                    KVD_SERVER_ALLOWED_UIDS="60011,60012")
    d = spawn_daemon(workdir, "--pool-size", "64MiB", "--extent-size", "4MiB", env=env,
                     socket=str(sockdir / "kvd.sock"))
    try:
        wrote = worker(d.socket, "store", "page_first", "tenant-pages", "6", "21", "60011")
        assert wrote == {"stored": [True] * 6, "exists": 6}
        theirs = worker(d.socket, "read", "page_first", "tenant-pages", "6", "21", "60012")
        assert theirs["exists"] == 0 and theirs["got"] == [False] * 6
        own = worker(d.socket, "read", "page_first", "tenant-pages", "6", "21", "60011")
        assert own["exists"] == 6 and all(own["match"])
    finally:
        d.close()
    assert "Traceback" not in d.log(), d.log()
