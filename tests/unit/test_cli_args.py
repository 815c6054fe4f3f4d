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

from kvd_proto import kvd_pb2
from kvd_server.cli import admin_client
from kvd_server.cli import main as cli
from kvd_server.cli import render as cli_render
from kvd_server.ops.stats import StatsSnapshot

SUBCOMMANDS = ("serve", "stats", "sessions", "reset", "drain", "health", "config")
CLIENT_COMMANDS = SUBCOMMANDS[1:]


def test_top_level_help_lists_every_subcommand(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out
    assert "Exit codes" in out


@pytest.mark.parametrize("name", CLIENT_COMMANDS)
def test_every_client_subcommand_takes_socket_and_timeout(capsys, name):
    assert cli.main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert "--socket" in out and "--timeout" in out


def test_serve_offers_only_the_options_it_uses(capsys):
    assert cli.main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--socket" in out and "--reflection" in out and "--log-format" in out
    assert "--timeout" not in out
    assert cli.main(["serve", "--timeout", "3"]) == 2
    assert "unrecognized arguments: --timeout" in capsys.readouterr().err


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


def test_zero_timeout_names_the_accepted_range(capsys):
    assert cli.main(["health", "--timeout", "0"]) == 2
    assert "must be more than 0 and at most 3600 seconds" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "hint"),
    [(["stat"], "(did you mean stats?)"), (["sesions"], "(did you mean sessions?)"),
     (["helth"], "(did you mean health?)"), (["stats", "--jsno"], "(did you mean --json?)"),
     (["sessions", "--wdie"], "(did you mean --wide?)"),
     (["serve", "--pool-szie=8G"], "(did you mean --pool-size?)"),
     (["health", "--socket", "/x", "--timout", "2"], "(did you mean --timeout?)")],
)
def test_typos_get_the_close_match(capsys, argv, hint):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert hint in err and "usage: kvd" in err, err


def test_config_refuses_serve_flags_without_local(capsys, tmp_path):
    assert cli.main(["config", "--pool-size", "8G", "--socket", str(tmp_path / "k")]) == 2
    err = capsys.readouterr().err
    assert "--pool-size needs --local" in err and err.count("\n") == 1
    assert cli.main(["config", "--config", str(tmp_path / "kvd.toml")]) == 2
    assert "--config needs --local" in capsys.readouterr().err


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


def test_file_backing_without_a_path_blames_the_flag(capsys):
    assert cli.main(["config", "--local", "--pool-backing", "file"]) == 1
    err = capsys.readouterr().err
    assert "pool.backing" in err and "(from flag --pool-backing)" in err
    assert "embedded defaults" not in err


def test_serve_switches_and_log_format_reach_the_config(capsys, monkeypatch):
    monkeypatch.delenv("KVD_CONFIG", raising=False)
    assert cli.main(["config", "--local", "--json", "--reflection", "--log-format", "json",
                     "--pool-size", "64Gi"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["server"]["reflection"] is True and doc["server"]["log_format"] == "json"
    assert doc["pool"]["size"] == 64 << 30


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
    text = cli_render.render_stats(StatsSnapshot.from_dict(SAMPLE))
    for section in ("server", "pool", "blocks", "sessions", "stats", "tenants",
                    "namespaces (1)", "rpc"):
        assert f"# {section}" in text
    assert "64MiB of 128MiB" in text and "of the pool (no quota)" in text
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "1GiB" in text and "64MiB (6.2%)" in text and "1h 2m 5s" in text
    assert "60 (60.0%)" in text


def test_stats_rendering_shows_the_sockets_connections():
    doc = dict(SAMPLE, connections={"open": 3, "refused_total": 2, "idle_closed_total": 5,
                                    "shed_total": 1, "attach_refused_total": 4})
    text = cli_render.render_stats(StatsSnapshot.from_dict(doc))
    assert "# connections" in text and all(len(line) <= 80 for line in text.splitlines())
    assert "3 to the gRPC socket" in text and "5 idle, 1 shed" in text
    assert "refused_total           2 (" in text and "attach_refused_total    4" in text


def test_stats_rendering_says_what_pins_and_leases_count():
    text = cli_render.render_stats(StatsSnapshot.from_dict(SAMPLE))
    assert "pinned (load or lease)  2" in text
    assert "load pins               2" in text and "lookup leases           1" in text
    assert "pins / leases" not in text


def _sessions() -> kvd_pb2.ListSessionsResponse:
    model = "meta-llama/Llama-3.1-70B-Instruct@0123456789abcdef"
    return kvd_pb2.ListSessionsResponse(total=1, sessions=[kvd_pb2.SessionInfo(
        session_id="s1-0123456789abcdef", tenant="team-a", peer_pid=4242, peer_uid=1000,
        model=model, pins=3, pending_stores=2**40, leases=7, idle_seconds=1.5)])


def test_sessions_cut_to_80_columns_or_whole_with_wide():
    text = cli_render.render_sessions(_sessions())
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "..." in text and "Llama-3.1-70B-Instruct@0123456789abcdef" not in text
    wide = cli_render.render_sessions(_sessions(), wide=True)
    assert "meta-llama/Llama-3.1-70B-Instruct@0123456789abcdef" in wide
    assert "s1-0123456789abcdef" in wide and str(2**40) in wide


def test_sessions_json_prints_64_bit_counts_as_numbers():
    doc = json.loads(json.dumps(cli_render.message_json(_sessions())))
    session = doc["sessions"][0]
    assert session["pending_stores"] == 2**40 and session["pins"] == 3 and session["leases"] == 7
    assert session["peer_pid"] == 4242 and doc["total"] == 1


def _squeezed(text: str) -> str:
    """Text without its whitespace: a value wrapped over lines reads as one again."""
    return "".join(text.split())


# A degraded cluster tier's reason as the store agent reports it (bounded at ~600 characters).
REASON = ("Mooncake's set-up failed (code -1); its client logged: not valid LAN address found "
          "[transfer_engine_impl.cpp:166] (first of 61 error lines; last: Failed to create "
          "client after 20 retries [real_client.cpp:865]); master 10.0.0.1:50051, metadata "
          "http://mooncake-master.kvd.svc.cluster.local:8080/metadata")


def test_stats_rendering_shows_the_reasons_whole_within_80_columns():
    """An operator reads why a tier is degraded, why a warm restart started cold, a long
    socket path or model: wrapped over lines of at most 80 columns, never cut."""
    socket_path = "/var/run/" + "a-deeply-nested-socket-directory/" * 3 + "kvd.sock"
    cold = ("its state record is unreadable: " + "x" * 40 + " (the record's version 7 is "
            "newer than this kvd's 1: start the newer kvd, or --cold)")
    doc = dict(SAMPLE, server=dict(SAMPLE["server"], socket=socket_path),
               restart={"enabled": True, "directory": "/dev/shm/kvd", "cold_reason": cold},
               tiers=[{"name": "cluster", "health": "degraded", "reason": REASON,
                       "directory": "10.0.0.1:50051"},
                      {"name": "disk", "health": "degraded", "reason": "disk full: " + "y" * 70,
                       "directory": "/var/lib/kvd/disk"}])
    text = cli_render.render_stats(StatsSnapshot.from_dict(doc))
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "..." not in text, text
    for whole in (REASON, cold, socket_path, "disk full: " + "y" * 70,
                  SAMPLE["namespaces"][0]["model"], "a-very-long-tenant-name-that-goes-on",
                  "AVeryLongMethodNameThatGoesOnAndOn"):
        assert _squeezed(whole) in _squeezed(text), whole
    cluster = text.split("# tier cluster")[1]
    assert cluster.splitlines()[1].startswith("health                  degraded: Mooncake")


def test_stats_rendering_says_who_forced_the_python_loops():
    """`KVD_NATIVE=0` in the daemon's environment is not a missing C compiler."""
    forced = cli_render.render_stats(StatsSnapshot.from_dict(
        dict(SAMPLE, channels={"native": False, "native_forced": True})))
    assert "KVD_NATIVE=0" in forced and "compiler" not in forced
    built = cli_render.render_stats(StatsSnapshot.from_dict(dict(SAMPLE, channels={})))
    assert _squeezed("no C compiler") in _squeezed(built) and "KVD_NATIVE" not in built


def test_stats_rendering_tolerates_an_empty_document():
    text = cli_render.render_stats(StatsSnapshot.from_dict({}))
    assert "# pool" in text


# gRPC's error text for TLS failures, as recorded from grpcio 1.85 (the multi-process TLS tests
# meet the common ones live).
_FAILED = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:7443: "


@pytest.mark.parametrize(
    ("details", "client_cert", "expected"),
    [
        (_FAILED + "Ssl handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:"
         "SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED", False,
         "the daemon's certificate is not trusted: pass --tls-ca CA.pem, the CA that signed it"),
        (_FAILED + "Ssl handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f0:"
         "SSL routines:OPENSSL_internal:UNSUPPORTED_PROTOCOL", False,
         "TLS handshake failed: UNSUPPORTED_PROTOCOL"),
        ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:7443: "
         "Socket closed", True,
         "the daemon closed the connection: is your certificate signed by its "
         "server.tls_client_ca?"),
        ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:7443: "
         "Connection refused", False, None),
    ],
)
def test_tls_failures_read_as_one_line(details, client_cert, expected):
    assert admin_client._tls_problem(details, client_cert) == expected
