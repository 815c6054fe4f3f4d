"""Warm restart keeps every namespace's index as a file (restart.warm): an empty namespace
forgotten when its last session ends takes its index, its eviction order and its record with
it, so the next daemon adopts the namespaces that hold blocks and nothing of the empty one,
and the same model comes back as a new namespace."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvd_client.offload.session import Lookup
from tests.support.daemon import HEARTBEAT, LIVENESS, clean_env
from tests.support.engine import keys_for
from tests.support.offload_engine import close_session, load, open_session, store
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc
POOL = ("--pool-size", "8MiB", "--extent-size", "1MiB")        # 128 slots of 64 KiB
ENV = clean_env(KVD_MANAGER_HEARTBEAT_INTERVAL=HEARTBEAT, KVD_MANAGER_LIVENESS_TIMEOUT=LIVENESS,
                KVD_SERVER_DRAIN_TIMEOUT="5s")


@pytest.fixture
def state_dir(workdir: Path):
    path = Path("/dev/shm") / f"kvd-empty-{workdir.name}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(start_daemon, state: Path, socket: str | None = None):
    return start_daemon(*POOL, "--warm-restart", "--restart-dir", str(state), env=ENV,
                        socket=socket)


def _kept(state: Path) -> tuple[set[str], set[str]]:
    """(namespace ids on record in state.json, namespace ids with an index or ranks file)."""
    record = json.loads((state / "state.json").read_text())
    files = {p.name.split("-", 1)[1] for p in state.iterdir()
             if p.name.startswith(("index-", "ranks-"))}
    return set(record["namespaces"]), files


def _ids(daemon) -> dict[str, str]:
    return {ns["model"]: ns["id"] for ns in daemon.stats()["namespaces"]}


def test_an_empty_namespace_leaves_no_file_and_no_record_for_the_next_daemon(start_daemon,
                                                                            state_dir):
    daemon = _start(start_daemon, state_dir)
    keys = keys_for("kept", 16)
    kept = open_session(daemon.socket, "kept")
    try:
        assert store(kept, keys) is not None
    finally:
        close_session(kept)
    empty = open_session(daemon.socket, "empty")       # maps its index, stores nothing
    empty_id = _ids(daemon)["empty"]
    assert empty_id in _kept(state_dir)[0] and empty_id in _kept(state_dir)[1]
    close_session(empty)
    wait_until(lambda: list(_ids(daemon)) == ["kept"], 5, "the empty namespace to go")
    kept_id = _ids(daemon)["kept"]
    assert _kept(state_dir) == ({kept_id}, {kept_id}), "the empty namespace left a file behind"

    daemon.proc.kill()
    daemon.proc.wait(20)
    daemon = _start(start_daemon, state_dir, socket=daemon.socket)
    restart = daemon.stats()["restart"]
    assert restart["namespaces_adopted"] == 1 and restart["namespaces_dropped"] == 0, restart
    assert restart["blocks_adopted"] == 16 and not restart["blocks_dropped"], restart
    assert list(_ids(daemon)) == ["kept"]
    again = open_session(daemon.socket, "kept")
    try:
        states, bad = load(again, keys)
        assert states == [Lookup.HIT] * 16 and not bad
    finally:
        close_session(again)
    # The empty one's model starts afresh, as a new namespace with a file of its own.
    fresh = open_session(daemon.socket, "empty")
    try:
        assert store(fresh, keys_for("fresh", 4)) is not None
        assert _ids(daemon)["empty"] in _kept(state_dir)[1]
    finally:
        close_session(fresh)
