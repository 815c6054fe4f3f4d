"""Agent sessions against a real daemon (docs/agents.md): a request's retention hint keeps its
blocks through a flood of other stores, within the tenant's quota, until the hint expires or
the session is released; `kvd session` and the admin API list, release and prewarm them (a
prewarm turns the next turn's HIT_PENDING into HIT); malformed hints are refused without harm.
Another tenant's calls (as another uid) see and change nothing (tests/support/as_user.py)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from kvd_client.offload.session import Lookup, OffloadSession
from kvd_proto import kvd_pb2
from kvd_proto import records as rec
from kvd_proto.attach import request_tenant_token
from kvd_proto.wire import TENANT_TOKEN_METADATA
from tests.support.daemon import as_user, clean_env, spawn_daemon
from tests.support.disk_tier import disk_env, tier_of
from tests.support.engine import keys_for
from tests.support.offload_engine import (
    close_session,
    load,
    open_session,
    settle,
    store,
    write_block,
)
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc
MODEL = "agent-model"
POOL = "8MiB"                  # 128 blocks of 64 KiB
FLOOD = 512                    # four times the pool
HINT = {"kvd": {"session": "s-1", "retain_s": 300}}


def _flood(session: OffloadSession, prefix: str, n: int = FLOOD) -> None:
    """Other sessions' traffic: `n` blocks stored by requests with no hint."""
    keys = keys_for(prefix, n)
    for i in range(0, n, 32):
        store(session, keys[i:i + 32], req_id=f"{prefix}-{i}")
        session.request_finished(f"{prefix}-{i}")


def _hinted(session: OffloadSession, req_id: str, keys: list[bytes], params: dict) -> None:
    """A request with a hint storing `keys`, then finished."""
    assert session.hint(req_id, params)
    for i in range(0, len(keys), 32):
        store(session, keys[i:i + 32], req_id=req_id)
    session.request_finished(req_id)
    settle(session)


def _hits(session: OffloadSession, keys: list[bytes], req_id: str = "") -> int:
    states, bad = load(session, keys, req_id)
    assert bad == [], f"{len(bad)} blocks served with bytes not their own"
    settle(session)
    return states.count(Lookup.HIT)


def _retention(daemon, tenant: str = "default") -> dict:
    return daemon.stats()["retention"]["tenants"].get(tenant, {})


def test_a_retained_session_survives_a_flood_and_the_quota_holds(start_daemon):
    daemon = start_daemon("--pool-size", POOL, "--extent-size", "4MiB",
                          env=clean_env(KVD_RETENTION_MAX_SHARE="0.25"))
    session = open_session(daemon.socket, MODEL, reserve=64)
    try:
        kept, plain = keys_for("agent", 24), keys_for("plain", 24)
        _hinted(session, "turn-1", kept, HINT)
        store(session, plain, req_id="no-hint")
        # 24 more retained blocks than the quota (a quarter of 128) has room for: 8 of them.
        extra = keys_for("extra", 24)
        _hinted(session, "turn-2", extra, {"kvd": {"session": "s-1"}})
        row = _retention(daemon)
        assert row["retained_blocks"] == 32 and row["cut_blocks_total"] == 16, row
        assert row["retained_bytes"] <= row["quota_bytes"] == (8 << 20) // 4
        _flood(session, "flood")
        assert _hits(session, kept) == len(kept), "retained blocks were evicted"
        assert _hits(session, extra[:8]) == 8
        assert _hits(session, plain) == 0, "the flood should have evicted unretained blocks"
        doc = daemon.stats()
        assert doc["blocks"]["retained"] == 32
        assert doc["retention"]["hints_total"] == 2
        assert _retention(daemon)["gave_way_blocks_total"] == 0
    finally:
        close_session(session)


def test_a_hint_expires_and_then_its_blocks_are_evicted_as_any(start_daemon):
    daemon = start_daemon("--pool-size", POOL, "--extent-size", "4MiB")
    session = open_session(daemon.socket, MODEL, reserve=64)
    try:
        keys = keys_for("short", 16)
        _hinted(session, "turn", keys, {"kvd": {"session": "brief", "retain_s": 0.5}})
        assert _retention(daemon)["retained_blocks"] == 16
        wait_until(lambda: _retention(daemon)["expired_blocks_total"] == 16, 10,
                   "the hint to expire")
        assert daemon.stats()["blocks"]["retained"] == 0
        _flood(session, "after")
        assert _hits(session, keys) == 0
    finally:
        close_session(session)


def _cli_json(daemon, *args: str) -> dict:
    out = daemon.kvd("session", *args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_release_and_prewarm_through_the_cli_and_the_api(start_daemon, tmp_path: Path):
    daemon = start_daemon("--pool-size", POOL, "--extent-size", "4MiB",
                          env=disk_env(tmp_path / "disk"))
    wait_until(lambda: tier_of(daemon)["health"] == "ok", 20, "the disk tier to open")
    session = open_session(daemon.socket, MODEL, reserve=64, keep_evicted=False)
    try:
        keys = keys_for("resume", 32)
        _hinted(session, "turn-1", keys, {"kvd": {"session": "agent-7", "retain_s": 600}})
        listed = _cli_json(daemon, "list")
        assert listed["tenant"] == "default"
        (row,) = listed["sessions"]
        assert (row["session"], row["retained_blocks"], row["model"]) == ("agent-7", 32, MODEL)
        text = daemon.kvd("session", "show", "agent-7")
        assert text.returncode == 0 and "32 retained block(s)" in text.stdout, text.stdout

        # Released: the blocks are ordinary again, and a flood pushes them out.
        out = daemon.kvd("session", "release", "agent-7")
        assert out.returncode == 0 and "32 block(s)" in out.stdout, out.stdout
        assert _cli_json(daemon, "list")["sessions"] == []
        assert daemon.kvd("session", "show", "agent-7").returncode == 1

        # The next turn loads them, retained only briefly: the flood then evicts them to the
        # disk tier, still tagged.
        assert session.hint("turn-2", {"kvd": {"session": "agent-7", "retain_s": 0.5}})
        assert _hits(session, keys, "turn-2") == 32
        session.request_finished("turn-2")
        wait_until(lambda: _retention(daemon)["retained_blocks"] == 0, 10, "the hint to expire")
        _flood(session, "others")
        wait_until(lambda: tier_of(daemon)["queue_depth"] == 0, 20, "demotions to finish")
        (row,) = _cli_json(daemon, "show", "agent-7")["namespaces"]
        assert row["below_blocks"] == 32 and row["retained_blocks"] == 0, row

        # The API, with a tenant token as `kvd session` uses: prewarm before the next turn.
        token, tenant = request_tenant_token(daemon.socket, 5.0)
        md = ((TENANT_TOKEN_METADATA, token),)
        answer = daemon.admin().PrewarmAgentSession(
            kvd_pb2.PrewarmAgentSessionRequest(session="agent-7"), metadata=md, timeout=5)
        assert answer.promoting_blocks == 32 and answer.namespaces == 1
        wait_until(lambda: _retention(daemon)["retained_blocks"] == 32, 20,
                   "the prewarmed blocks to land (retained)")
        # The resumed turn: HIT at its first lookup, byte-exact (no HIT_PENDING).
        assert session.hint("turn-3", {"kvd": {"session": "agent-7", "retain_s": 600}})
        states, bad = load(session, keys, "turn-3")
        assert states == [Lookup.HIT] * 32 and bad == []
        settle(session)
        row = _retention(daemon)
        assert row["prewarmed_blocks_total"] == 32 and row["prewarm_hits_total"] == 32, row
        listed = daemon.admin().ListAgentSessions(kvd_pb2.ListAgentSessionsRequest(),
                                                  metadata=md, timeout=5)
        assert listed.tenant == tenant == "default"
        assert [s.session for s in listed.sessions] == ["agent-7"]
        out = daemon.kvd("session", "prewarm", "--key", keys[0].hex())
        assert out.returncode == 0 and "1 in it already" in out.stdout, out.stdout
        released = daemon.admin().ReleaseAgentSession(
            kvd_pb2.ReleaseAgentSessionRequest(session="agent-7"), metadata=md, timeout=5)
        assert released.released_blocks == 32
        # No token: refused.
        with pytest.raises(Exception, match="PERMISSION_DENIED|tenant token"):
            daemon.admin().ListAgentSessions(kvd_pb2.ListAgentSessionsRequest(), timeout=5)
    finally:
        close_session(session)


def test_malformed_hints_are_refused_without_harm(start_daemon):
    daemon = start_daemon("--pool-size", POOL, "--extent-size", "4MiB",
                          env=clean_env(KVD_RETENTION_MAX_S="10m",
                                        KVD_RETENTION_MAX_TAG_BYTES="16"))
    session = open_session(daemon.socket, MODEL, reserve=64)
    try:
        bad = [{"kvd": "s"}, {"kvd": {"session": 7}}, {"kvd": {"retain_s": -1}},
               {"kvd": {"retain_s": "300"}}, {"kvd": {"retain_s": True}},
               {"kvd": {"retain_s": 1e12}}, {"kvd": {"session": "x" * 5000}},
               {"kvd": {"session": "a\nb"}}, {"kvd": {"session": "s", "pin": True}},
               {"kvd": {"retain_s": float("nan")}}, ["kvd"]]
        for i, params in enumerate(bad):
            assert not session.hint(f"bad-{i}", params), params
        assert session.hints_refused == len(bad)
        # Well formed for the client, refused by this daemon's bounds: REJECTED, counted.
        assert session.hint("long-tag", {"kvd": {"session": "t" * 17}})
        assert session.hint("long-wait", {"kvd": {"session": "s", "retain_s": 3600}})
        session._put([rec.encode_hint("", "s", 1000)])            # no request: malformed
        for i in range(200):                                      # a storm of them
            session._put([rec.encode_hint(f"storm-{i}", "t" * 64, 1000)])
        settle(session)
        keys = keys_for("after-bad", 16)
        _hinted(session, "long-tag", keys, {"kvd": {"session": "fine", "retain_s": 60}})
        assert _hits(session, keys) == 16
        doc = daemon.stats()
        # The tag, the retention and the storm; the record with no request never decoded.
        assert doc["retention"]["hints_refused_total"] == 202, doc["retention"]
        assert _retention(daemon)["retained_blocks"] == 16
        # One line per interval, not one per refusal.
        assert daemon.log().count("refused") <= 3, daemon.log()
        assert daemon.serving()
    finally:
        close_session(session)


A, B = 60011, 60012


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run clients as other uids")
def test_another_tenant_can_neither_see_release_nor_prewarm_a_session(workdir: Path):
    os.chmod(workdir, 0o755)
    sockdir = workdir / "s"
    sockdir.mkdir()
    os.chmod(sockdir, 0o777)
    env = clean_env(KVD_SERVER_SOCKET_MODE="0666", KVD_TENANTS_UIDS=f"{A}=team-a,{B}=team-b",
                    KVD_SERVER_ALLOWED_UIDS=f"0,{A},{B}")
    daemon = spawn_daemon(workdir, "--pool-size", POOL, "--extent-size", "4MiB", env=env,
                          socket=str(sockdir / "kvd.sock"))
    session = open_session(daemon.socket, MODEL, reserve=64)
    try:
        keys = keys_for("mine", 16)
        _hinted(session, "turn", keys, HINT)           # tenant "default" (root)
        for uid in (A, B):
            listed = as_user(uid, daemon.socket, "cli", "session", "list", "--json")
            assert listed["rc"] == 0, listed
            doc = json.loads(listed["stdout"])
            assert doc["sessions"] == [] and doc["tenant"] in ("team-a", "team-b")
            shown = as_user(uid, daemon.socket, "cli", "session", "show", "s-1")
            assert shown["rc"] == 1
            out = as_user(uid, daemon.socket, "cli", "session", "release", "s-1")
            assert out["rc"] == 0 and "0 block(s)" in out["stdout"], out
            out = as_user(uid, daemon.socket, "cli", "session", "prewarm", "s-1")
            assert out["rc"] == 0 and "0 block(s) being promoted" in out["stdout"], out
            # Every tenant's view needs admin permission.
            out = as_user(uid, daemon.socket, "cli", "session", "list", "--all-tenants")
            assert out["rc"] == 1 and "admin permission" in out["stderr"], out
        assert _retention(daemon)["retained_blocks"] == 16
        assert _hits(session, keys) == 16
        # The operator (root) sees every tenant's.
        out = daemon.kvd("session", "list", "--all-tenants", "--json")
        assert out.returncode == 0, out.stderr
        assert [s["tenant"] for s in json.loads(out.stdout)["sessions"]] == ["default"]
    finally:
        close_session(session)
        daemon.close()
    assert "Traceback" not in daemon.log(), daemon.log()


def test_retention_survives_a_warm_restart(start_daemon, workdir: Path):
    """The daemon killed (a crash) and started again over its warm-restart files: the
    retained blocks are adopted retained, under their session's tag, with the time their
    hints had left; they still outlast a flood, and their session releases them."""
    state = Path("/dev/shm") / f"kvd-agents-{workdir.name}"
    args = ("--pool-size", POOL, "--extent-size", "1MiB", "--warm-restart", "--restart-dir",
            str(state))
    try:
        daemon = start_daemon(*args)
        session = open_session(daemon.socket, MODEL, reserve=16)
        kept, short = keys_for("kept", 24), keys_for("short", 8)
        _hinted(session, "turn-1", kept, {"kvd": {"session": "s-warm", "retain_s": 600}})
        _hinted(session, "turn-2", short, {"kvd": {"session": "s-brief", "retain_s": 1}})
        close_session(session)
        daemon.proc.kill()
        daemon.proc.wait(20)
        time.sleep(3)              # s-brief's hint runs out while it is down (whole seconds)
        daemon = start_daemon(*args, socket=daemon.socket)
        assert daemon.stats()["restart"]["blocks_adopted"] == 32
        (row,) = _cli_json(daemon, "list")["sessions"]
        assert (row["session"], row["retained_blocks"]) == ("s-warm", 24), row
        assert 500 < row["expires_in_seconds"] <= 600
        session = open_session(daemon.socket, MODEL, reserve=64)
        try:
            _flood(session, "after-restart")
            assert _hits(session, kept) == 24
            assert _hits(session, short) == 0
            out = daemon.kvd("session", "release", "s-warm")
            assert out.returncode == 0 and "24 block(s)" in out.stdout, out.stdout
        finally:
            close_session(session)
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_the_client_library_lists_prewarms_and_releases(start_daemon):
    from kvd_client.agents import AgentSessions, AgentSessionsError

    daemon = start_daemon("--pool-size", POOL, "--extent-size", "4MiB")
    session = open_session(daemon.socket, MODEL, reserve=64)
    try:
        keys = keys_for("lib", 8)
        _hinted(session, "turn", keys, {"kvd": {"session": "lib-1", "retain_s": 60}})
        with AgentSessions(daemon.socket) as agents:
            (row,) = agents.list()
            assert (row.session, row.retained_blocks, row.model) == ("lib-1", 8, MODEL)
            assert agents.tenant == "default"
            assert agents.list("nobody") == []
            warm = agents.prewarm("lib-1", retain_s=120)
            assert (warm.promoting_blocks, warm.in_pool_blocks) == (0, 8)   # no tier below
            assert agents.release("lib-1") == 8 and agents.release("lib-1") == 0
            with pytest.raises(ValueError):
                agents.prewarm("lib-1", retain_s=-1)
            with pytest.raises(AgentSessionsError, match="INVALID_ARGUMENT"):
                agents.prewarm("")
    finally:
        close_session(session)


def test_a_release_voids_the_hints_of_stores_still_in_flight(start_daemon):
    """An agent's last turn ends (its harness releases the session) while the turn's stores
    are still being copied: their completions arrive after the release and retain nothing."""
    daemon = start_daemon("--pool-size", POOL, "--extent-size", "4MiB")
    session = open_session(daemon.socket, MODEL, reserve=64)
    try:
        keys = keys_for("late", 8)
        assert session.hint("last", {"kvd": {"session": "done-1", "retain_s": 600}})
        granted = None
        for _ in range(500):
            granted = session.reserve(keys, "last")
            if granted is not None:
                break
            session.end_step()
            time.sleep(0.01)
        assert granted is not None
        session.request_finished("last")
        settle(session)
        out = daemon.kvd("session", "release", "done-1")
        assert out.returncode == 0, out.stderr
        for key, offset in granted:
            write_block(session, offset, key)
        session.complete_store(keys, "last")
        settle(session)
        assert _retention(daemon)["retained_blocks"] == 0
        assert _hits(session, keys) == 8
        # The same session hinting again after the release retains as any.
        _hinted(session, "again", keys_for("later", 4), {"kvd": {"session": "done-1"}})
        assert _retention(daemon)["retained_blocks"] == 4
    finally:
        close_session(session)


def test_the_call_protocol_carries_hints_too(start_daemon):
    """An engine on the gRPC call protocol (a client written from the proto alone): Hint, or
    a step's hint op, before the request's calls; a malformed one is INVALID_ARGUMENT."""
    import grpc

    from tests.support.engine import Engine

    daemon = start_daemon("--pool-size", POOL, "--extent-size", "4MiB")
    engine = Engine(daemon.socket, MODEL)
    try:
        engine.call("Hint", kvd_pb2.HintRequest(req_id="r", session="grpc-1",
                                                retain_ms=60_000))
        engine.store(keys_for("grpc", 6))                       # req_id "r"
        engine.call("Step", kvd_pb2.StepRequest(ops=[kvd_pb2.StepOp(
            hint=kvd_pb2.HintRequest(req_id="r", session="grpc-1"))]))
        assert _retention(daemon)["retained_blocks"] == 6
        with pytest.raises(grpc.RpcError) as refused:
            engine.call("Hint", kvd_pb2.HintRequest(req_id="r", session="s",
                                                    retain_ms=(1 << 32) - 1))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        (row,) = _cli_json(daemon, "list")["sessions"]
        assert (row["session"], row["retained_blocks"]) == ("grpc-1", 6)
    finally:
        engine.close()
