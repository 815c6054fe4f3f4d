"""`make test`'s vLLM install prints no false pip error (issue 22, item 7).

vLLM 0.33.0 pins torch 2.14.0 and CUDA packages; the tests run it on torch 2.13.0's CPU build
with the pure-Python subset in tools/vllm-test-requirements.txt. Installed with --no-deps after
that subset, pip has nothing to complain about; installed before it, pip's after-install check
printed a 41-line "ERROR: pip's dependency resolver ..." block that every `make test` showed.
The fast test reads the Makefile's commands; the soak one runs them in a scratch venv (here,
not in tests/unit, so that `make test-fast` stays fast and offline).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _recipe(venv: pathlib.Path) -> list[str]:
    """The commands `make vllm-env` runs for a venv that does not exist yet."""
    out = subprocess.run(["make", "-n", "vllm-env", f"VENV={venv}", f"PYTHON={sys.executable}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_vllm_goes_in_last_without_its_dependencies(tmp_path):
    lines = _recipe(tmp_path / "venv")
    installs = [n for n, line in enumerate(lines) if " -m pip " in line and " install " in line]
    (vllm,) = [n for n in installs if "vllm==" in lines[n]]
    assert "--no-deps" in lines[vllm], lines[vllm]
    # Nothing is pip-installed after it: a later install would run pip's check against
    # vLLM's full requirements (torch==2.14.0, the CUDA packages) and print them all.
    assert vllm == installs[-1], lines
    (reqs,) = [n for n in installs if "vllm-test-requirements.txt" in lines[n]]
    assert reqs < vllm
    # A rerun over an installed vllm (the stamp is older than the requirements) stays quiet.
    assert "--no-warn-conflicts" in lines[reqs], lines[reqs]
    # And the one line that says why the pins differ.
    assert any("without its dependencies" in line and "torch 2.13.0" in line
               for line in lines[vllm:]), lines


@pytest.mark.soak
def test_make_vllm_env_in_a_scratch_venv_prints_no_pip_error(tmp_path):
    """The real install (minutes, from the package registries) into a new venv, as a fresh
    clone's `make test` does, then again over it: no pip ERROR either time."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=ROOT, capture_output=True, check=True,
                           timeout=60).stdout.decode().split("\0")
    checkout = tmp_path / "checkout"
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    venv = tmp_path / "venv"
    for attempt in ("first", "rerun"):
        if attempt == "rerun":
            (checkout / "tools" / "vllm-test-requirements.txt").touch()  # the stamp re-runs
        out = subprocess.run(["make", "vllm-env", f"VENV={venv}", f"PYTHON={sys.executable}"],
                             cwd=checkout, env=env, capture_output=True, text=True, timeout=1500)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        text = out.stdout + out.stderr
        assert "ERROR" not in text and "dependency conflicts" not in text, (attempt, text[-4000:])
    check = subprocess.run([str(venv / "bin" / "python"), "-c", "import vllm, torch, kvd_client;"
                            "print(vllm.__version__, torch.__version__)"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and check.stdout.startswith("0.33.0 2.13.0"), check
