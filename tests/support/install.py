"""What the install tests (tests/multiproc/test_install.py, test_install_script.py) share: the
version pyproject.toml states, the bound on one install or build, an environment free of this
checkout's and this venv's paths, and two module fixtures: a copy of the files a fresh clone
has, and the wheel the Containerfile builds from it. A test module that wants the fixtures
binds them (`checkout = install.checkout`); each module then builds its own, once."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.daemon import ROOT, clean_env

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
INSTALL_TIMEOUT = 600


def installer_env() -> dict[str, str]:
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
                           "--wheel-dir", str(out), "."], cwd=checkout, env=installer_env(),
                          capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("*.whl")
    # A platform wheel: it carries kvd_proto._native, built for this Python.
    assert re.fullmatch(rf"kvd_offload-{VERSION}-cp3\d+-cp3\d+-linux_\w+\.whl", path.name), path
    return path
