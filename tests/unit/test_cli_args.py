"""The `kvd` command line: help, argument errors, local config, one-line failures, rendering."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvd_server import cli
from kvd_server.stats import StatsSnapshot

SUBCOMMANDS = ("serve", "stats", "sessions", "reset", "drain", "health", "config")


def test_top_level_help_lists_every_subcommand(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out
    assert "Exit codes" in out


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_takes_socket_and_timeout(capsys, name):
    assert cli.main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert "--socket" in out and "--timeout" in out


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("kvd ")


@pytest.mark.parametrize(
    "argv",
    [[], ["frobnicate"], ["stats", "--timeout", "soon"], ["health", "--timeout", "0"],
     ["stats", "--bogus"]],
)
def test_malformed_command_lines_exit_2(capsys, argv):
    assert cli.main(argv) == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["stats", "sessions", "drain", "health", "config"])
def test_absent_daemon_is_one_line_and_exit_2(tmp_path, capsys, name):
    path = str(tmp_path / "kvd.sock")
    assert cli.main([name, "--socket", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"no kvd daemon socket at {path}" in err and "kvd serve" in err


def test_reset_without_daemon(tmp_path, capsys):
    assert cli.main(["reset", "--yes", "--socket", str(tmp_path / "kvd.sock")]) == 2


def test_stale_socket_is_reported(tmp_path, capsys):
    path = str(tmp_path / "kvd.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)  # bound but never listening: connect is refused
        assert cli.main(["health", "--socket", path]) == 2
    err = capsys.readouterr().err
    assert "nothing is listening" in err and "Traceback" not in err


def test_permission_denied_is_reported(tmp_path):
    """A socket the caller may not open: one line naming the fix, exit 2 (run as nobody)."""
    path = str(tmp_path / "kvd.sock")
    os.chmod(tmp_path, 0o755)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)
        sock.listen()
        os.chmod(path, 0o600)
        if os.geteuid() == 0:
            # Root is never denied: ask as an unprivileged user instead.
            demote = lambda: (os.setgid(65534), os.setuid(65534))  # noqa: E731
        else:
            os.chmod(path, 0)
            demote = None
        root = str(Path(__file__).resolve().parents[2])
        try:
            out = subprocess.run([sys.executable, "-m", "kvd_server", "stats", "--socket", path],
                                 capture_output=True, text=True, timeout=30, cwd="/",
                                 env={**os.environ, "PYTHONPATH": root}, preexec_fn=demote)
        except PermissionError as exc:
            pytest.skip(f"an unprivileged user cannot run this interpreter: {exc}")
    if "Permission denied" in out.stderr and "kvd:" not in out.stderr:
        pytest.skip(f"the checkout is not readable by an unprivileged user: {out.stderr[-200:]}")
    assert out.returncode == 2, out.stderr
    assert "permission denied on" in out.stderr and "Traceback" not in out.stderr


def test_config_local_applies_flags(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVD_CONFIG", raising=False)
    monkeypatch.setenv("KVD_MANAGER_POLICY", "arc")
    sock = str(tmp_path / "k.sock")
    assert cli.main(["config", "--local", "--socket", sock, "--pool-size", "8GiB",
                     "--liveness-timeout", "3s", "--log-level", "debug"]) == 0
    doc = tomllib.loads(capsys.readouterr().out)
    assert doc["server"]["socket"] == sock
    assert doc["server"]["log_level"] == "debug"
    assert doc["pool"]["size"] == "8GiB"
    assert doc["manager"]["policy"] == "arc"
    assert doc["manager"]["liveness_timeout"] == "3s"
    assert cli.main(["config", "--local", "--json", "--socket", sock]) == 0
    assert json.loads(capsys.readouterr().out)["pool"]["size"] == 1 << 30


def test_config_local_reads_the_file(tmp_path, capsys):
    path = tmp_path / "kvd.toml"
    path.write_text('[pool]\nsize = "128MiB"\n')
    assert cli.main(["config", "--local", "--config", str(path)]) == 0
    assert tomllib.loads(capsys.readouterr().out)["pool"]["size"] == "128MiB"


def test_bad_flag_value_names_the_flag(capsys):
    assert cli.main(["config", "--local", "--pool-size", "huge"]) == 1
    err = capsys.readouterr().err
    assert "pool.size" in err and "flag --pool-size" in err and "Traceback" not in err


def test_serve_refuses_bad_config_before_starting(tmp_path, capsys):
    assert cli.main(["serve", "--socket", str(tmp_path / "k.sock"), "--policy", "fifo"]) == 1
    assert "manager.policy" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "k.sock")


SAMPLE = {
    "server": {"version": "0.1.0", "pid": 42, "uptime_seconds": 3725.5, "state": "serving",
               "socket": "/run/kvd/kvd.sock", "attach_socket": "/run/kvd/kvd.sock.attach",
               "policy": "lru", "instance_id": "ab" * 8},
    "pool": {"total_bytes": 1 << 30, "used_bytes": 64 << 20, "free_bytes": 960 << 20,
             "backing": "memfd", "path": None, "extent_bytes": 64 << 20, "extents_total": 16,
             "extents_free": 15, "prefault_bytes_done": 1 << 30, "mlocked": False},
    "blocks": {"storing": 1, "ready": 30, "pinned": 2, "zombie": 0, "total": 33},
    "sessions": 2,
    "clients": {"active": 2, "attached_total": 5, "reaped_total": 1, "closed_total": 2},
    "namespaces": [{"id": "f" * 64, "model": "meta-llama/Llama-3.1-8B-Instruct@main" * 2,
                    "tenant": "a-very-long-tenant-name", "slot_bytes": 2 << 20,
                    "block_bytes": 2 << 20, "num_ranks": 1, "slots_capacity": 32, "extents": 1,
                    "epoch": 0, "blocks": {"storing": 1, "ready": 30, "pinned": 2, "zombie": 0},
                    "lookups_total": 100, "hits_total": 60, "misses_total": 40}],
    "stats": {"lookups_total": 100, "hits_total": 60, "misses_total": 40, "pins": 2,
              "leases": 1, "step_calls_total": 7, "step_ops_total": 20},
    "tenants": {"a-very-long-tenant-name-that-goes-on": {"used_bytes": 64 << 20,
                                                         "quota_bytes": 128 << 20},
                "default": {"used_bytes": 0, "quota_bytes": 0}},
    "transfers": {"load_bytes_total": 123 << 20, "load_seconds_total": 0.5,
                  "store_bytes_total": 10 << 30, "store_seconds_total": 2.0},
    "rpc": {"Step": {"calls_total": 7, "errors_total": 0},
            "AVeryLongMethodNameThatGoesOnAndOn": {"calls_total": 10**9, "errors_total": 3}},
}


def test_stats_rendering_is_grouped_and_fits_80_columns():
    text = cli.render_stats(StatsSnapshot.from_dict(SAMPLE))
    for section in ("server", "pool", "blocks", "sessions", "stats", "tenants",
                    "namespaces (1)", "rpc"):
        assert f"# {section}" in text
    assert "64MiB of 128MiB" in text and "of the pool (no quota)" in text
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "1GiB" in text and "64MiB (6.2%)" in text and "1h 2m 5s" in text
    assert "60 (60.0%)" in text


def test_stats_rendering_tolerates_an_empty_document():
    text = cli.render_stats(StatsSnapshot.from_dict({}))
    assert "# pool" in text
