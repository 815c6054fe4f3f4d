"""The C sources have one list, setup.py's: every .c and .h of the packages is named there (as
an extension's source or dependency), and the Makefile's rebuild rule reads it (an edited
source the Makefile did not know left a stale extension in place: `_decode.c` once did)."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _setup_sources() -> set[str]:
    """The files setup.py's Extensions name in `sources` and `depends`."""
    named: set[str] = set()
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.keyword) and node.arg in ("sources", "depends"):
            value = node.value
            assert isinstance(value, ast.List), f"setup.py's {node.arg} must be a literal list"
            named.update(ast.literal_eval(value))
    return named


def test_every_c_file_of_the_packages_is_named_in_setup_py() -> None:
    on_disk = {p.relative_to(ROOT).as_posix()
               for package in ("kvd_proto", "kvd_server", "kvd_client")
               for pattern in ("*.c", "*.h") for p in (ROOT / package).rglob(pattern)}
    named = _setup_sources()
    assert on_disk, "no C source found: is ROOT right?"
    assert on_disk == named, (f"not in setup.py: {sorted(on_disk - named)}; "
                              f"in setup.py but absent: {sorted(named - on_disk)}")


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_the_makefile_rebuilds_on_every_source_setup_py_names() -> None:
    out = subprocess.run(["make", "-s", "--no-print-directory", "--eval",
                          "show-native: ; @echo $(NATIVE)", "show-native"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    listed = set(out.stdout.split())
    assert "setup.py" in listed
    assert listed - {"setup.py"} == _setup_sources()
