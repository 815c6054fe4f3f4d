"""Isolation and permissions against a real daemon, with clients running as other users.

The clients start as root and drop to uids 60001 (tenant team-a, quota 8 MiB) and 60002
(team-b) before they talk to the daemon (tests/support/as_user.py), so the daemon sees them
through SO_PEERCRED exactly as it would see engines of two teams on one node.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvd_proto import kvd_pb2
from tests.support.daemon import as_user, clean_env, spawn_daemon
from tests.support.engine import keys_for
from tests.support.summary import record

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run clients as other uids"),
]

A, B, OUTSIDER, STRANGER = 60001, 60002, 60003, 60004
ISOLATION_ROUNDS = max(1, int(os.environ.get("KVD_SOAK_ROUNDS", "10")) // 10)
HIT, MISS = kvd_pb2.BLOCK_STATE_HIT, kvd_pb2.BLOCK_STATE_MISS
QUOTA_A = 8 << 20              # two 4 MiB extents: 128 blocks of 64 KiB


@pytest.fixture
def shared_daemon(workdir: Path):
    """A daemon whose socket directory every uid may enter, with two mapped tenants."""
    os.chmod(workdir, 0o755)
    sockdir = workdir / "s"
    sockdir.mkdir()
    os.chmod(sockdir, 0o777)
    env = clean_env(KVD_SERVER_SOCKET_MODE="0666", KVD_MANAGER_HEARTBEAT_INTERVAL="200ms",
                    KVD_MANAGER_LIVENESS_TIMEOUT="1s",
                    KVD_TENANTS_UIDS=f"{A}=team-a,{B}=team-b",
                    KVD_TENANTS_QUOTAS=f"team-a={QUOTA_A}",
                    KVD_SERVER_ADMIN_UIDS=str(B),
                    KVD_SERVER_ALLOWED_UIDS=f"{A},{B},{OUTSIDER}")
    daemon = spawn_daemon(workdir, "--pool-size", "64MiB", "--extent-size", "4MiB", env=env,
                          socket=str(sockdir / "kvd.sock"))
    try:
        yield daemon
    finally:
        daemon.close()
    assert "Traceback" not in daemon.log(), daemon.log()


def test_tenant_cannot_hit_load_or_overwrite_another_tenants_blocks(shared_daemon):
    sock = shared_daemon.socket
    b = as_user(B, sock, "engine", "llama", "shared", "32", "team-b")
    assert b["tenant"] == "team-b" and b["stored"] == 32 and b["own_match"]
    # Same model, same keys, same layout: team-a sees nothing of team-b's, cannot load it,
    # and its own store of the same keys lands in its own namespace.
    a = as_user(A, sock, "engine", "llama", "shared", "32", "team-a")
    assert a["tenant"] == "team-a"
    assert set(a["states"]) == {MISS}, a["states"]
    assert a["load_code"] == "FAILED_PRECONDITION"
    assert a["stored"] == 32 and a["own_match"]
    # team-b's blocks and bytes are untouched by everything team-a did.
    again = as_user(B, sock, "verify", "llama", "shared", "32", "team-b")
    assert set(again["states"]) == {HIT} and again["match"], again
    # Claiming a tenant in the attach request changes nothing.
    assert as_user(A, sock, "claim", "team-b")["tenant"] == "team-a"
    # A uid outside server.allowed_uids may open the socket but not attach.
    stranger = as_user(STRANGER, sock, "claim", "team-a")
    assert not stranger["ok"] and stranger["code"] == "PERMISSION_DENIED", stranger


@pytest.mark.fault
def test_a_tenants_descriptor_covers_none_of_another_tenants_bytes(shared_daemon):
    """Isolation by the kernel, not just the index: team-a's engines map a pool file in which
    team-b's blocks do not exist, so nothing they read or write can reach them (rounds of it
    in `make soak`, with extents moving between the tenants as they evict)."""
    sock = shared_daemon.socket
    for round_ in range(ISOLATION_ROUNDS):
        tag = f"secret-{round_}"
        b = as_user(B, sock, "engine", "llama", tag, "32", "team-b")
        assert b["stored"] == 32 and b["own_match"]
        a = as_user(A, sock, "scan", "llama", tag, "32", "team-b")
        assert a["tenant"] == "team-a" and a["pool_bytes"] == 64 << 20
        assert a["found"] == 0, "team-b's bytes are readable through team-a's descriptor"
        again = as_user(B, sock, "verify", "llama", tag, "32", "team-b")
        assert set(again["states"]) == {HIT} and again["match"], "team-a overwrote team-b's blocks"
        record("isolation checks")
    # One budget for the node: team-a's stray writes cost it, not the pool (given back).
    doc = shared_daemon.stats()
    assert doc["pool"]["used_bytes"] + doc["pool"]["free_bytes"] == doc["pool"]["total_bytes"]


def test_tenant_quota_holds_and_only_its_own_blocks_are_evicted(shared_daemon):
    sock = shared_daemon.socket
    b = as_user(B, sock, "engine", "llama", "b-keep", "200", "team-b")
    assert b["stored"] == 200
    # team-a stores 3x its quota in three rounds: it never holds more than 8 MiB, it evicts
    # only its own blocks, and team-b keeps every block and byte.
    evicted = 0
    for round_ in range(3):
        a = as_user(A, sock, "engine", "llama", f"a{round_}", "128", "team-a")
        assert a["stored"] == 128 and a["own_match"] and not a["cannot_store"], a
        evicted += a["evicted"]
        doc = shared_daemon.stats()
        assert doc["tenants"]["team-a"]["used_bytes"] <= QUOTA_A, doc["tenants"]
        assert doc["tenants"]["team-a"]["quota_bytes"] == QUOTA_A
    assert evicted == 256
    again = as_user(B, sock, "verify", "llama", "b-keep", "200", "team-b")
    assert set(again["states"]) == {HIT} and again["match"]
    # One store bigger than the whole quota is refused, not served by taking team-b's room.
    big = as_user(A, sock, "engine", "llama", "a-big", "129", "team-a")
    assert big["cannot_store"] and big["stored"] == 0
    ns = {n["tenant"]: n for n in shared_daemon.stats()["namespaces"]}
    assert ns["team-a"]["extents"] == 2


def test_reset_and_drain_need_admin_permission(shared_daemon):
    sock = shared_daemon.socket
    keys = keys_for("admin", 4)
    assert as_user(A, sock, "engine", "llama", "admin", "4", "team-a")["stored"] == len(keys)
    refused = as_user(OUTSIDER, sock, "token")
    assert not refused["ok"] and refused["code"] == "PERMISSION_DENIED"
    cli = as_user(OUTSIDER, sock, "cli", "reset", "--yes")
    assert cli["rc"] == 1 and "no admin permission" in cli["stderr"], cli
    cli = as_user(A, sock, "cli", "drain")
    assert cli["rc"] == 1 and "PERMISSION_DENIED" in cli["stderr"], cli
    # Read-only calls stay open to anyone who can reach the socket.
    assert as_user(OUTSIDER, sock, "cli", "stats")["rc"] == 0
    assert shared_daemon.stats()["blocks"]["ready"] == len(keys)
    # B is in server.admin_uids: its reset goes through.
    assert as_user(B, sock, "token")["ok"]
    assert as_user(B, sock, "cli", "reset", "--yes")["rc"] == 0
    assert shared_daemon.stats()["blocks"]["ready"] == 0
    assert shared_daemon.serving()
