"""`--log-level debug` tells a developer what the daemon did in a normal session (attaches with
what was handed over, channels, namespaces created and forgotten with their layouts, grants,
channel records) in a bounded number of lines, never one per key; and a start that fails after
the summary lines ends with the error, which names the fix."""

from __future__ import annotations

import re
import socket
import subprocess
import time

import pytest

from tests.support.daemon import PY, ROOT, clean_env
from tests.support.engine import keys_for
from tests.support.offload_engine import close_session, load, open_session, settle, store
from tests.support.waits import wait_until

pytestmark = pytest.mark.multiproc

MODEL = "debug-model"
KEYS = 48                  # blocks one session stores and loads: none of them may show up


def _session(daemon) -> None:
    """One engine: open, store and load KEYS blocks, close."""
    session = open_session(daemon.socket, MODEL, reserve=8)
    try:
        keys = keys_for("debug", KEYS)
        assert store(session, keys) is not None
        states, bad = load(session, keys)
        assert bad == []
        settle(session)
    finally:
        close_session(session)


def _debug_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if " DEBUG " in line]


def test_debug_shows_a_sessions_attaches_channel_namespace_and_grants(start_daemon):
    env = clean_env(KVD_MANAGER_HEARTBEAT_INTERVAL="200ms", KVD_MANAGER_LIVENESS_TIMEOUT="2s",
                    KVD_TENANTS_NAMESPACE_IDLE_TIMEOUT="1s", KVD_SERVER_DRAIN_TIMEOUT="5s")
    daemon = start_daemon("--pool-size", "16MiB", "--extent-size", "4MiB", "--log-level",
                          "debug", env=env)
    _session(daemon)
    assert daemon.kvd("reset", "--yes").returncode == 0     # no block left: it goes idle
    wait_until(lambda: "forgot 1 namespaces" in daemon.log(), 20, "the namespace forgotten")
    time.sleep(1.5)                                # one more activity look
    assert daemon.kvd("drain").returncode == 0
    assert daemon.proc.wait(timeout=15) == 0
    log = daemon.log()
    lines = _debug_lines(log)
    text = "\n".join(lines)
    assert re.search(r"attach: pid \d+ uid \d+ gid \d+ as engine \(engine test-\d+\): 1 "
                     r"descriptor\(s\), session_id \S+, tenant \S+, pool_bytes 16777216", text), log
    assert re.search(r"as index: 2 descriptor\(s\), session_id \S+, index_bytes \d+", text), log
    assert re.search(r"as channel: 2 descriptor\(s\), session_id \S+, channel_bytes \d+", text)
    assert re.search(r"channel of session \S+ closed; it held \d+ slots granted \(reserve "
                     r"target \d+\)", text), log
    assert re.search(rf"namespaces created: \w+ \(model {MODEL}, tenant \S+, block 64KiB = "
                     r"1 x 64KiB, 16 tokens, bfloat16\)", text), log
    assert re.search(rf"namespaces forgotten: \w+ \({MODEL}\)", text), log
    assert re.search(r"channel records [^\n]*store \d+", text), log
    assert "token" not in text.replace("tokens,", ""), "a token in the debug log"
    # Bounded: a few lines per event and per second, none per key.
    assert len(lines) < 60, text
    for key in keys_for("debug", KEYS):
        assert key.hex() not in log


def test_info_shows_none_of_it(daemon):
    _session(daemon)
    time.sleep(1.5)
    assert _debug_lines(daemon.log()) == []
    assert "activity:" not in daemon.log() and "attach: pid" not in daemon.log()


def test_a_startup_error_after_the_summary_is_the_last_line_and_names_the_fix(workdir):
    """The pool does not fit: five INFO lines, then the error, last."""
    out = subprocess.run([PY, "-m", "kvd_server", "serve", "--socket", str(workdir / "k.sock"),
                          "--pool-size", "1000TiB"], env=clean_env(), capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert sum(" INFO " in line for line in lines) >= 5, out.stderr
    assert " ERROR " in lines[-1] and "Choose a smaller pool.size" in lines[-1], out.stderr
    assert "Traceback" not in out.stderr


def test_a_metrics_port_in_use_is_the_last_line_and_names_the_fix(workdir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        out = subprocess.run([PY, "-m", "kvd_server", "serve", "--socket",
                              str(workdir / "k.sock"), "--pool-size", "4MiB",
                              "--metrics-port", str(port)], env=clean_env(),
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert " ERROR " in last and f"127.0.0.1:{port}" in last, out.stderr
    assert "--metrics-port" in last, out.stderr
    assert not (workdir / "k.sock").exists() and not (workdir / "k.sock.lock").exists()

