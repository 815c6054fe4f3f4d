"""A real Mooncake master on loopback for the cluster tier's tests, and whether one can run.

The master (`mooncake_master`, installed with the `cluster` extra beside the Python that runs
the tests) listens on free loopback ports: its RPC port, its HTTP metadata server and its
metrics/admin port. `stop` kills it (SIGKILL: a master that dies), `start` brings it back on
the same ports, empty (Mooncake's non-HA master keeps nothing across a restart).

`loopback_netns` makes a network namespace with loopback only (a container without a LAN
address, where Mooncake's client cannot set up); a master and daemons run in it through the
command prefix it gives (`Master(..., enter=prefix)`), and the tests still reach the daemons
through their Unix sockets.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.support.waits import wait_until

MASTER = Path(sys.executable).parent / "mooncake_master"


@functools.cache
def unavailable() -> str:
    """Why a Mooncake master and client cannot run here ("" when they can)."""
    if not MASTER.exists():
        return (f"no {MASTER.name} beside {sys.executable}: pip install "
                "'kvd-offload[cluster]' (make test installs it)")
    probe = subprocess.run([sys.executable, "-c", "from mooncake.store import "
                            "MooncakeDistributedStore"], capture_output=True, text=True,
                           timeout=60)
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return (f"the Mooncake client does not load ({tail}): it needs Debian's libibverbs1 "
                "and librdmacm1 (make test installs them when run as root)")
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int, enter: Sequence[str] = ()) -> bool:
    if enter:                        # inside another network namespace: ask from there
        probe = ("import socket, sys; s = socket.socket(); s.settimeout(0.2); "
                 f"sys.exit(s.connect_ex(('127.0.0.1', {port})))")
        return subprocess.run([*enter, sys.executable, "-c", probe], timeout=30).returncode == 0
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def netns_unavailable() -> str:
    """Why this process cannot make a network namespace ("" when it can)."""
    if os.geteuid() != 0:
        return "making a network namespace needs root"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"no {tool} here (util-linux, iproute2)"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True,
                           timeout=30)
    if probe.returncode != 0:
        return f"unshare -n fails here: {probe.stderr.strip() or probe.returncode}"
    return ""


@contextlib.contextmanager
def loopback_netns() -> Iterator[list[str]]:
    """A network namespace with loopback only, held by a sleeping process for as long as the
    context lasts; yields the prefix that runs a command in it."""
    holder = subprocess.Popen(["unshare", "-n", "sh", "-c",
                               "ip link set lo up && echo up && exec sleep 3600"],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "up"
        yield ["nsenter", f"--net=/proc/{holder.pid}/ns/net"]
    finally:
        holder.kill()
        holder.wait(10)


class Master:
    """One master process (see the module doc); `enter`: the prefix that runs it in another
    network namespace."""

    def __init__(self, workdir: Path, enter: Sequence[str] = ()) -> None:
        self.enter = list(enter)
        self.rpc_port = _free_port()
        self.http_port = _free_port()
        self.metrics_port = _free_port()
        self.log_path = workdir / "mooncake-master.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(
            [*self.enter, str(MASTER), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http_port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics_port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        wait_until(lambda: self.proc.poll() is not None or (
            _listening(self.rpc_port, self.enter) and _listening(self.http_port, self.enter)),
            30,
            "the Mooncake master to listen")
        if self.proc.poll() is not None:
            raise AssertionError(f"mooncake_master exited: {self.log()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
