"""The socket directory's permissions, told in one line naming the directory and the uid: a
`kvd serve` whose uid cannot write in an existing directory (it used to end in a 25-line
PermissionError traceback from the bind), and clients (the CLI, an engine's KvdClient) that a
0750 directory keeps out (they used to blame the socket or "another daemon").

The other uid is real: this file, run as a module, imports what it needs as root, drops to
the uid and gid given, then runs `kvd ARGS...` (`cli`) or connects a KvdClient (`client`).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.daemon import PY, ROOT, clean_env

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run processes as other uids"),
]

USER = 60005


def as_user(uid: int, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "tests.multiproc.test_socket_dir", str(uid), *args],
                          env=clean_env(), capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.fixture
def open_workdir(workdir: Path) -> Path:
    os.chmod(workdir, 0o755)        # everyone may pass; what is inside decides
    return workdir


def test_serve_in_a_directory_it_cannot_write_says_so_in_one_line(open_workdir: Path):
    sockdir = open_workdir / "root-only"
    sockdir.mkdir(mode=0o755)                      # root's, not writable by USER
    out = as_user(USER, "cli", "serve", "--socket", str(sockdir / "kvd.sock"),
                  "--pool-size", "4MiB")
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "PermissionError" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert " ERROR " in last and str(sockdir) in last and f"uid {USER}" in last, out.stderr
    assert "kvd.sock.attach" in last and "mode 0755" in last, last
    assert "--socket" in last, last                 # the fix
    assert list(sockdir.iterdir()) == []


def test_serve_in_a_read_only_directory_as_root_says_so(open_workdir: Path):
    """Root may write anywhere but on a read-only file system: the same one line."""
    proc_ro = Path("/proc/self")                   # a read-only directory root cannot write
    if os.access(proc_ro, os.W_OK):
        pytest.skip("no read-only directory to try")
    out = subprocess.run([PY, "-m", "kvd_server", "serve", "--socket",
                          str(proc_ro / "kvd.sock"), "--pool-size", "4MiB"], env=clean_env(),
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "/proc/self" in last and "uid 0" in last, out.stderr


def test_clients_kept_out_by_the_socket_directory_name_it(start_daemon, open_workdir: Path):
    """The daemon makes its socket directory 0750 for its own user: another uid's `kvd
    health` and KvdClient say that this directory keeps them out, and which uid they are."""
    sockdir = open_workdir / "run"
    daemon = start_daemon("--pool-size", "4MiB", "--extent-size", "1MiB",
                          socket=str(sockdir / "kvd.sock"))
    assert oct(sockdir.stat().st_mode & 0o777) == "0o750"
    out = as_user(USER, "cli", "health", "--socket", daemon.socket)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert f"the directory {sockdir}" in line and f"uid {USER}" in line, line
    assert "mode 0750" in line and "another" not in line, line

    out = as_user(USER, "client", daemon.socket)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["available"] is False
    assert f"the directory {sockdir}" in out.stderr and f"uid {USER}" in out.stderr, out.stderr


def _main(argv: list[str]) -> int:
    """`UID cli ARGS...` or `UID client SOCKET`, as UID (gid the same)."""
    import uvloop  # noqa: F401  (everything imported before the uid drop)

    import kvd_server.server  # noqa: F401
    from kvd_client.client import KvdClient
    from kvd_proto.wire import KvLayout
    from kvd_server.cli import main as cli

    uid, action, *rest = argv
    os.setgroups([])
    os.setgid(int(uid))
    os.setuid(int(uid))
    if action == "cli":
        return cli.main(rest)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    client = KvdClient(rest[0], model="m", layout=KvLayout(4096, 1, 4096), deadline_s=1.0)
    try:
        available = client.wait_available(2.0)
    finally:
        client.close()
    print(json.dumps({"available": available}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
