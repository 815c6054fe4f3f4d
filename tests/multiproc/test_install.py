"""The install path the systemd unit and the image use (deploy/install.sh), run for real into a
temporary prefix: from a checkout and from the wheel the Containerfile builds. The installed
`kvd` then serves, answers `health --wait` and drains, with nothing from this checkout on its
path."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.daemon import ROOT, clean_env

pytestmark = pytest.mark.multiproc
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
INSTALL_TIMEOUT = 600


def _installer_env() -> dict[str, str]:
    """A plain environment: none of this checkout's or this venv's paths."""
    env = clean_env()
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(ROOT)))
    return env


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the files a fresh clone has (tracked, or new and not ignored); builds write
    into it."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=ROOT, capture_output=True,
                           check=True, timeout=60).stdout.decode().split("\0")
    copy = tmp_path_factory.mktemp("checkout")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    return copy


@pytest.fixture(scope="module")
def wheel(checkout: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel the Containerfile's first stage builds (`pip wheel --no-deps .`)."""
    out = tmp_path_factory.mktemp("wheels")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                           "--wheel-dir", str(out), "."], cwd=checkout, env=_installer_env(),
                          capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("*.whl")
    # A platform wheel: it carries kvd_proto._native, built for this Python.
    assert re.fullmatch(rf"kvd_offload-{VERSION}-cp3\d+-cp3\d+-linux_\w+\.whl", path.name), path
    return path


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
                          env=_installer_env(), capture_output=True, text=True,
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
        env = _installer_env()
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
                             env=_installer_env(), cwd="/", capture_output=True, text=True,
                             timeout=60)
    assert located.stdout.startswith(str(prefix)), located   # the installed copy, not ours
    serving(kvd)


def test_install_from_the_wheel_with_an_extra_and_again_to_upgrade(wheel: Path, tmp_path: Path,
                                                                    serving):
    script = ROOT / "deploy" / "install.sh"
    prefix, kvd = _install(tmp_path, script, "--extras", "reflection", str(wheel))
    check = subprocess.run([str(prefix / "bin" / "python"), "-c", "import grpc_reflection"],
                           env=_installer_env(), capture_output=True, text=True, timeout=60)
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
                             env=_installer_env(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and message in out.stderr, (args, out.stderr)
        assert not (tmp_path / "p").exists()
