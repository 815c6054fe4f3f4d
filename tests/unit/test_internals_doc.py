"""docs/internals.md is the module map: reading it tells a newcomer which module owns what. So
it names every module of the three packages by its path, and every module path it names
exists (a module added, moved or removed without the page following fails here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "internals.md"
PACKAGES = ("kvd_proto", "kvd_server", "kvd_client")
# A module path as the page writes it: `kvd_server/manager/policies/lru.py`.
MODULE_PATH = re.compile(r"(?<![\w/])kvd_(?:proto|server|client)(?:/\w+)+\.py(?!\w)")


def _modules() -> list[str]:
    """Every module of the packages, by path; package __init__s and generated protobuf code
    (`*_pb2*.py`, `make proto`) aside."""
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__init__.py" or "_pb2" in path.name:
                continue
            out.append(path.relative_to(ROOT).as_posix())
    return out


def _named() -> set[str]:
    return set(MODULE_PATH.findall(DOC.read_text()))


def test_every_module_is_named_by_its_path():
    modules = _modules()
    assert len(modules) > 50, f"found only {len(modules)} modules: is ROOT right?"
    missing = [m for m in modules if m not in _named()]
    assert not missing, f"docs/internals.md does not name: {', '.join(missing)}"


def test_every_module_path_named_exists():
    named = _named()
    assert named, "docs/internals.md names no module path"
    absent = sorted(p for p in named if not (ROOT / p).is_file())
    assert not absent, f"docs/internals.md names modules that do not exist: {', '.join(absent)}"
