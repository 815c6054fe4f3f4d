"""kvd_client.register against a real daemon: a registration owns what it made, and a refused
or impossible one leaves nothing behind (no session, the reason named by its step)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvd_client.register import RegisterFailed, register, session_fds
from kvd_proto import kvd_pb2
from kvd_proto.attach import ROLE_INDEX
from kvd_proto.wire import KvLayout
from tests.support.engine import Engine

LAYOUT = KvLayout(4096, 1, 4096, 16, "bfloat16")
ENGINE = kvd_pb2.EngineIdentity(engine_id="register-test", pid=os.getpid())


def test_a_registration_holds_the_session_and_its_descriptors(daemon):
    reg = register(daemon.socket, engine=ENGINE, model="reg-model", layout=LAYOUT, salt="",
                   timeout=5.0)
    try:
        assert reg.session_id and reg.namespace_id and reg.slot_bytes == 4096
        assert reg.pool_bytes == reg.pool.size and reg.heartbeat_interval_s >= 0.05
        assert daemon.stats()["clients"]["active"] == 1
        fds = session_fds(daemon.socket, ROLE_INDEX, reg.metadata[0][1], 5.0)
        assert fds is not None
        for fd in fds:
            os.close(fd)
        reg.stub.CloseSession(kvd_pb2.CloseSessionRequest(), timeout=5.0,
                              metadata=reg.metadata)
    finally:
        reg.channel.close()
        reg.pool.close()


def test_the_daemon_answers_the_lease_to_ask_for(daemon):
    """RegisterSessionResponse.default_lease_ms, the daemon's manager.default_lease (2 s by
    default): what a call-protocol client asks for on lookups (kvd_client holds no leases, so
    it keeps no copy; clients in other languages read it)."""
    engine = Engine(daemon.socket)
    try:
        assert engine.reg is not None and engine.reg.default_lease_ms == 2000
    finally:
        engine.close()


def test_a_refused_registration_is_undone(daemon):
    with pytest.raises(RegisterFailed, match=r"^register: "):
        register(daemon.socket, engine=ENGINE, model="", layout=LAYOUT, salt="", timeout=5.0)
    # register() ends the refused session before it raises: none is left (well inside the
    # daemon's liveness timeout, which would reap a leaked one and hide it)
    assert daemon.stats()["clients"]["active"] == 0


def test_no_daemon_fails_at_attach(workdir: Path):
    with pytest.raises(RegisterFailed, match=r"^attach: "):
        register(str(workdir / "none.sock"), engine=ENGINE, model="m", layout=LAYOUT,
                 salt="", timeout=1.0)


def test_a_token_the_daemon_does_not_know_gets_no_descriptors(daemon):
    from kvd_client.attach import AttachError

    with pytest.raises(AttachError):
        session_fds(daemon.socket, ROLE_INDEX, "not-a-token", 5.0)


def test_a_dropped_session_is_replaced_by_a_new_registration(daemon):
    from kvd_client.client import KvdClient

    client = KvdClient(daemon.socket, model="reg-model", layout=LAYOUT, deadline_s=2.0)
    try:
        assert client.wait_available(10)
        first, generation = client.session_id, client.generation
        client.drop_session("a test gives it up")
        assert client.wait_available(10)
        assert client.generation == generation + 1 and client.session_id != first
        assert client.previous_session_id == first
    finally:
        client.close()
