"""Every code example in README.md and docs/*.md runs, against a real daemon.

How the examples are run (the conventions for whoever writes the docs):

- ```python blocks run in order, in one interpreter per page (a later block sees what an earlier
  one defined), with a daemon serving on the default socket ($XDG_RUNTIME_DIR/kvd/kvd.sock, a
  64 MiB pool), in a temporary working directory.
- ```sh and ```bash blocks run one by one under `bash -euo pipefail` in a fresh
  $XDG_RUNTIME_DIR with no daemon running and this checkout's `kvd` first on PATH; whatever a
  block leaves running in the background is stopped after it.
- ```toml blocks must load as a configuration file (what `kvd config --local --config F` does).
- Other fences (```, ```json, ```text) show output or formats and are not run.
- `<!-- not-run: REASON -->` on the line before a fence leaves that block out; the reason says
  why (it needs root, a GPU, another host...) and, where one exists, which test covers it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvd_server.config import ConfigError, load_config
from tests.support.daemon import PY, ROOT, clean_env, spawn_daemon
from tests.support.doc_examples import (
    FENCE,
    NOT_RUN,
    RUN_TIMEOUT,
    RUNNER,
    Example,
    examples,
)

pytestmark = pytest.mark.multiproc
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = ("sh", "bash")
ALL = [example for page in PAGES for example in examples(page)]


def _selected(*langs: str) -> list[Example]:
    return [e for e in ALL if e.lang in langs and e.skip is None]


def _python_pages() -> list[str]:
    return sorted({e.page for e in _selected("python")})


def test_the_docs_have_examples_to_run():
    assert _python_pages() and _selected(*SHELLS) and _selected("toml")


def test_every_not_run_marker_stands_before_a_fence():
    for path in PAGES:
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if "not-run" in line:
                assert NOT_RUN.match(line), f"{path.name}:{number + 1}: write " \
                                            "<!-- not-run: REASON -->"
                following = next((x for x in lines[number + 1:] if x.strip()), "")
                assert FENCE.match(following), f"{path.name}:{number + 1}: no fence follows"


# --- python: one interpreter per page, a daemon on the default socket ----------------------


@pytest.mark.parametrize("page", _python_pages())
def test_python_examples_run(page: str, workdir: Path):
    runtime = workdir / "run"
    env = clean_env(XDG_RUNTIME_DIR=str(runtime))
    daemon = spawn_daemon(workdir, "--pool-size", "64MiB", env=env,
                          socket=str(runtime / "kvd" / "kvd.sock"))
    try:
        blocks = [(e.page, e.line, e.code) for e in _selected("python") if e.page == page]
        cwd = workdir / "cwd"
        cwd.mkdir()
        out = subprocess.run([PY, "-c", RUNNER], input=json.dumps(blocks), env=env, cwd=cwd,
                             capture_output=True, text=True, timeout=RUN_TIMEOUT)
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        daemon.close()
    assert "Traceback" not in daemon.log(), daemon.log()


# --- sh: each block alone, no daemon, this checkout's kvd on PATH --------------------------


def _kvd_on_path(directory: Path) -> str:
    """A directory holding a `kvd` that runs this checkout with this interpreter."""
    directory.mkdir()
    shim = directory / "kvd"
    shim.write_text(f'#!/bin/sh\nexec "{PY}" -m kvd_server "$@"\n')
    shim.chmod(0o755)
    return str(directory)


def _stop_group(pgid: int) -> None:
    """Stop what a block left in the background (a daemon drains on SIGTERM)."""
    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


@pytest.mark.parametrize("example", _selected(*SHELLS), ids=lambda e: e.name)
def test_shell_examples_run(example: Example, workdir: Path):
    runtime, cwd = workdir / "run", workdir / "cwd"
    runtime.mkdir(mode=0o700)
    cwd.mkdir()
    path = _kvd_on_path(workdir / "bin") + os.pathsep + os.environ.get("PATH", "")
    env = clean_env(XDG_RUNTIME_DIR=str(runtime), PATH=path)
    log = workdir / "output.log"
    with open(log, "wb") as sink:   # a file, not a pipe: background jobs may outlive bash
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", example.code], env=env,
                                cwd=cwd, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        proc.wait(timeout=RUN_TIMEOUT)
    finally:
        _stop_group(proc.pid)
    output = log.read_text(errors="replace")
    assert proc.returncode == 0, f"{example.name} failed:\n{output}"
    assert "Traceback" not in output, output


# --- toml: a configuration file kvd reads -------------------------------------------------


@pytest.mark.parametrize("example", _selected("toml"), ids=lambda e: e.name)
def test_toml_examples_are_valid_configuration(example: Example, tmp_path: Path):
    path = tmp_path / "kvd.toml"
    path.write_text(example.code)
    try:
        load_config(str(path), env={})
    except ConfigError as exc:
        pytest.fail(f"{example.name}: {exc}")
