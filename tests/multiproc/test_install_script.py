"""deploy/install.sh as an operator meets it again: a rerun, a rebuilt wheel of the same version,
a venv that Debian's `python3 -m venv` left half-made, and `sudo deploy/install.sh` from a
user's checkout. Real installs into a temporary prefix, from the wheel and checkout that
tests/multiproc/test_install.py builds (no network beyond the package registries)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import install
from tests.support.install import INSTALL_TIMEOUT, VERSION, installer_env

pytestmark = pytest.mark.multiproc
# The copy of a fresh clone and the wheel built from it, as test_install.py makes them.
checkout = install.checkout
wheel = install.wheel
SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "install.sh"
# What a fresh clone lacks (the wheel fixture builds in the shared checkout copy).
FRESH = shutil.ignore_patterns("build", "*.egg-info", "*.so", "__pycache__")


def _run(tmp_path: Path, *args: str, python: str = sys.executable,
         script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script), "--prefix", str(tmp_path / "opt-kvd"),
                           "--bin-dir", str(tmp_path / "bin"), "--python", python, *args],
                          env=installer_env(), capture_output=True, text=True,
                          timeout=INSTALL_TIMEOUT, cwd=tmp_path)


def _installed(tmp_path: Path, module: str) -> str:
    """The text of an installed module's source file, read from the prefix's site-packages."""
    (path,) = (tmp_path / "opt-kvd").glob(f"lib/python3*/site-packages/{module}")
    return path.read_text()


def _rebuilt(wheel: Path, checkout: Path, tmp_path: Path, marker: str) -> Path:
    """The same version built again from a changed checkout: what `make wheel` gives after an
    edit, with the same file name."""
    copy = tmp_path / "rebuilt-src"
    shutil.copytree(checkout, copy, ignore=FRESH)
    with open(copy / "kvd_client" / "__init__.py", "a") as f:
        f.write(f"\n# {marker}\n")
    out = tmp_path / "rebuilt"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                           "--wheel-dir", str(out), "."], cwd=copy, env=installer_env(),
                          capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("*.whl")
    assert path.name == wheel.name
    return path


def test_a_rebuilt_wheel_of_the_same_version_is_really_reinstalled(wheel: Path, checkout: Path,
                                                                     tmp_path: Path):
    first = _run(tmp_path, str(wheel))
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"kvd {VERSION} installed in {tmp_path / 'opt-kvd'};" in first.stdout, first.stdout
    assert "rebuilt-marker" not in _installed(tmp_path, "kvd_client/__init__.py")

    rebuilt = _rebuilt(wheel, checkout, tmp_path, "rebuilt-marker")
    second = _run(tmp_path, str(rebuilt))
    assert second.returncode == 0, second.stdout + second.stderr
    assert "rebuilt-marker" in _installed(tmp_path, "kvd_client/__init__.py")
    # It says what it did: the same version, installed again over itself.
    assert f"kvd {VERSION} installed in {tmp_path / 'opt-kvd'} (reinstalled over {VERSION}" \
        in second.stdout, second.stdout

    # And a third run, nothing changed, is as good: the same files, the same message, exit 0.
    third = _run(tmp_path, str(rebuilt))
    assert third.returncode == 0, third.stdout + third.stderr
    assert third.stdout == second.stdout
    assert "rebuilt-marker" in _installed(tmp_path, "kvd_client/__init__.py")
    version = subprocess.run([str(tmp_path / "bin" / "kvd"), "--version"], env=installer_env(),
                             capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and VERSION in version.stdout, version


def _debian_python_without_venv(tmp_path: Path) -> Path:
    """A python3 like Debian's without the python3-venv package: `-m venv` makes the directory
    and bin/python, then fails on ensurepip; everything else is the real interpreter."""
    fake = tmp_path / "debian-python3"
    fake.write_text(
        "#!/bin/bash\n"
        'if [ "$1" = -m ] && [ "$2" = venv ]; then\n'
        "  shift 2\n"
        f'  "{sys.executable}" -m venv --without-pip "$@"\n'
        '  echo "The virtual environment was not created successfully because ensurepip is not'
        ' available." >&2\n'
        "  exit 1\n"
        "fi\n"
        f'exec "{sys.executable}" "$@"\n')
    fake.chmod(0o755)
    return fake


def test_a_half_made_venv_is_recreated_on_the_next_run(wheel: Path, tmp_path: Path):
    prefix = tmp_path / "opt-kvd"
    failed = _run(tmp_path, str(wheel), python=str(_debian_python_without_venv(tmp_path)))
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "apt-get install python3-venv" in failed.stderr, failed.stderr
    # What Debian leaves behind: an interpreter, no pip.
    assert (prefix / "bin" / "python").exists() and not (prefix / "bin" / "pip").exists()

    # The operator installs python3-venv and runs it again: the venv is made anew.
    again = _run(tmp_path, str(wheel))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "recreating it" in again.stdout, again.stdout
    assert f"kvd {VERSION} installed in {prefix};" in again.stdout, again.stdout
    assert (tmp_path / "bin" / "kvd").resolve() == (prefix / "bin" / "kvd").resolve()


def test_a_prefix_that_is_not_a_venv_is_refused_untouched(wheel: Path, tmp_path: Path):
    """E.g. `--prefix /usr` by mistake: an interpreter with a working pip, but no venv."""
    prefix = tmp_path / "opt-kvd"
    (prefix / "bin").mkdir(parents=True)
    # A stand-in for the system's python3: it answers `-m pip --version` and records anything
    # else it is asked (a real one here would be this test run's own environment).
    asked = tmp_path / "asked"
    (prefix / "bin" / "python").write_text(
        '#!/bin/bash\n[ "$*" = "-m pip --version" ] && exit 0\n'
        f'echo "$*" >> {asked}\nexit 1\n')
    (prefix / "bin" / "python").chmod(0o755)
    (prefix / "data").write_text("someone's")
    out = _run(tmp_path, str(wheel))
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"{prefix} exists and is not a virtual environment" in out.stderr, out.stderr
    assert not asked.exists(), asked.read_text()
    assert sorted(p.name for p in prefix.iterdir()) == ["bin", "data"]
    assert (prefix / "data").read_text() == "someone's"
    assert not (tmp_path / "bin").exists()


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_uid, p.lstat().st_gid)
            for p in root.rglob("*")}


def test_sudo_from_a_users_checkout_leaves_nothing_in_it(checkout: Path, tmp_path: Path):
    """As root (sudo) from a checkout a user owns: the build happens elsewhere, so no
    root-owned build/, *.egg-info/ or compiled module is left in the user's tree."""
    users = tmp_path / "home-checkout"
    shutil.copytree(checkout, users, ignore=FRESH)
    if os.geteuid() == 0:
        owner = 65534                                 # nobody: the user who cloned it
        for path in [users, *users.rglob("*")]:
            os.lchown(path, owner, owner)
    before = _listing(users)
    assert not any(name.startswith(("build", "kvd_offload.egg-info")) for name in before)

    for _ in range(2):                                # and a rerun, the same
        out = _run(tmp_path, script=users / "deploy" / "install.sh")
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"kvd {VERSION} installed in {tmp_path / 'opt-kvd'}" in out.stdout, out.stdout
        assert _listing(users) == before, sorted(set(_listing(users)) ^ set(before))
    assert "reinstalled over" in out.stdout, out.stdout
