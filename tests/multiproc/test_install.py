"""The install path the systemd unit and the image use (deploy/install.sh), run for real into a
temporary prefix: from a checkout and from the wheel the Containerfile builds. The installed
`kvd` then serves, answers `health --wait` and drains, with nothing from this checkout on its
path."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import install
from tests.support.daemon import ROOT
from tests.support.install import INSTALL_TIMEOUT, VERSION, installer_env

pytestmark = pytest.mark.multiproc
# The copy of a fresh clone and the wheel built from it (tests/support/install.py).
checkout = install.checkout
wheel = install.wheel


def test_the_wheel_holds_the_three_packages_the_command_and_the_data(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {
        "kvd_server", "kvd_client", "kvd_proto", f"kvd_offload-{VERSION}.dist-info"}
    assert any(re.fullmatch(r"kvd_proto/_native\..*\.so", name) for name in names), names
    for data in ("kvd_server/default_config.toml", "kvd_proto/kvd.proto",
                 "kvd_proto/kvd_pb2.pyi", f"kvd_offload-{VERSION}.dist-info/licenses/LICENSE"):
        assert data in names, data
    entry_points = zipfile.ZipFile(wheel).read(
        f"kvd_offload-{VERSION}.dist-info/entry_points.txt").decode()
    assert "kvd = kvd_server.cli.main:main" in entry_points


def _install(tmp_path: Path, script: Path, *args: str) -> tuple[Path, Path]:
    prefix, bin_dir = tmp_path / "opt" / "kvd", tmp_path / "usr-local-bin"
    proc = subprocess.run(["bash", str(script), "--prefix", str(prefix), "--bin-dir",
                           str(bin_dir), "--python", sys.executable, *args],
                          env=installer_env(), capture_output=True, text=True,
                          timeout=INSTALL_TIMEOUT, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"kvd {VERSION} installed in {prefix}" in proc.stdout
    kvd = bin_dir / "kvd"
    assert kvd.is_symlink() and kvd.resolve() == (prefix / "bin" / "kvd").resolve()
    return prefix, kvd


@pytest.fixture
def serving(workdir: Path) -> Iterator[Callable[[Path], None]]:
    """Run an installed `kvd serve` the way the quick start does, and stop it at teardown."""
    procs: list[subprocess.Popen[bytes]] = []

    def run(kvd: Path) -> None:
        env = installer_env()
        sock = str(workdir / "run" / "kvd.sock")
        with open(workdir / "serve.log", "wb") as log:
            procs.append(subprocess.Popen([str(kvd), "serve", "--socket", sock, "--pool-size",
                                           "8M"], env=env, cwd="/", stdout=log,
                                          stderr=subprocess.STDOUT))
        for argv, expected in (([str(kvd), "health", "--wait", "60", "--socket", sock],
                                "SERVING\n"),
                               ([str(kvd), "drain", "--socket", sock], "draining")):
            out = subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True,
                                 timeout=120)
            assert out.returncode == 0 and out.stdout.startswith(expected), out.stderr
        assert procs[0].wait(timeout=60) == 0, (workdir / "serve.log").read_text()

    yield run
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_install_from_a_checkout_serves(checkout: Path, tmp_path: Path, serving):
    prefix, kvd = _install(tmp_path, checkout / "deploy" / "install.sh")
    located = subprocess.run([str(prefix / "bin" / "python"), "-c",
                              "import kvd_server; print(kvd_server.__file__)"],
                             env=installer_env(), cwd="/", capture_output=True, text=True,
                             timeout=60)
    assert located.stdout.startswith(str(prefix)), located   # the installed copy, not ours
    serving(kvd)


def test_install_from_the_wheel_with_an_extra_and_again_to_upgrade(wheel: Path, tmp_path: Path,
                                                                    serving):
    script = ROOT / "deploy" / "install.sh"
    prefix, kvd = _install(tmp_path, script, "--extras", "reflection", str(wheel))
    check = subprocess.run([str(prefix / "bin" / "python"), "-c", "import grpc_reflection"],
                           env=installer_env(), capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    _install(tmp_path, script, str(wheel))     # a second run over the first one
    serving(kvd)


def test_install_refuses_what_it_cannot_use(tmp_path: Path):
    script = str(ROOT / "deploy" / "install.sh")
    for args, message in (([str(tmp_path / "missing.whl")], "does not exist"),
                          ([str(tmp_path)], "is not a kvd checkout"),
                          (["--python", "no-such-python3"], "no-such-python3 not found"),
                          (["--frobnicate"], "unknown option --frobnicate")):
        out = subprocess.run(["bash", script, "--prefix", str(tmp_path / "p"), *args],
                             env=installer_env(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and message in out.stderr, (args, out.stderr)
        assert not (tmp_path / "p").exists()
