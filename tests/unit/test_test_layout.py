"""Where the tests' shared helpers live, held against the tests' imports.

A test module (tests/**/test_*.py) is a leaf: nothing imports it. A helper another test needs
is not borrowed from the test module that happened to define it first (importing a test module
runs its module-level set-up, couples two tests' private names, and hides the helper from
whoever looks for it), it lives in a helper module. A helper shared across test directories
lives in tests/support/ (docs/internals.md lists its modules); a helper module of one
directory (tests/vllm/harness.py, tests/fault/crash_points.py, ...) serves that directory
only. Every import counts, wherever it stands (inside a function too) and however it is
spelled (`from tests.x.test_y import n`, `import tests.x.test_y`, `from tests.x import test_y`,
`from .test_y import n`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.imports import imports_of, module_name

ROOT = Path(__file__).resolve().parents[2]
SHARED = "support"        # the directory under tests/ any test directory may import from


def _modules(root: Path) -> dict[str, Path]:
    """Every module and package under tests/, by dotted name."""
    return {module_name(root, p): p for p in sorted((root / "tests").rglob("*.py"))}


def _is_test_module(name: str) -> bool:
    return name.rpartition(".")[2].startswith("test_")


def _directory(root: Path, path: Path) -> str:
    """The directory under tests/ a module sits in ("" for tests/ itself)."""
    parts = path.relative_to(root / "tests").parts
    return parts[0] if len(parts) > 1 else ""


def violations(root: Path) -> list[str]:
    """What breaks the layout under `root`/tests, one line each naming the file, the line and
    the import."""
    modules = _modules(root)
    found: list[str] = []
    for name, path in modules.items():
        where = path.relative_to(root).as_posix()
        home = _directory(root, path)
        for line, target, text in imports_of(name, path, modules):
            target_dir = _directory(root, modules[target])
            if _is_test_module(target):
                found.append(f"{where}:{line}: imports the test module {target} ({text}); "
                             "what two tests share belongs in a helper module (tests/support/ "
                             "when other directories use it too)")
            elif target_dir not in (home, SHARED) and target != "tests":
                found.append(f"{where}:{line}: imports {target} of tests/{target_dir} "
                             f"({text}); a helper shared across test directories lives in "
                             "tests/support/")
    return found


def test_no_test_module_is_imported_and_shared_helpers_live_in_support():
    assert len(_modules(ROOT)) > 50, "found too few modules under tests/: is ROOT right?"
    found = violations(ROOT)
    assert not found, "\n".join(found)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in {"tests/__init__.py": "", "tests/a/__init__.py": "",
                      "tests/b/__init__.py": "", "tests/support/__init__.py": "",
                      "tests/support/tools.py": "X = 1\n", "tests/a/helper.py": "Y = 1\n",
                      "tests/a/test_one.py": "Z = 1\n", **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


@pytest.mark.parametrize("spelling", [
    "from tests.a.test_one import Z",
    "import tests.a.test_one",
    "from tests.a import test_one",
    "from .test_one import Z",
    "def f():\n    from tests.a.test_one import Z\n",
])
def test_an_import_of_a_test_module_is_named(tmp_path: Path, spelling: str):
    root = _tree(tmp_path, {"tests/a/test_two.py": spelling + "\n"})
    (found,) = violations(root)
    assert found.startswith("tests/a/test_two.py:") and "tests.a.test_one" in found, found


@pytest.mark.parametrize("spelling", ["from tests.a.helper import Y", "import tests.a.helper",
                                      "from tests.a import helper"])
def test_a_helper_of_another_directory_is_named(tmp_path: Path, spelling: str):
    root = _tree(tmp_path, {"tests/b/test_two.py": spelling + "\n"})
    (found,) = violations(root)
    assert found.startswith("tests/b/test_two.py:1:") and "tests.a.helper" in found, found
    assert "tests/support/" in found


def test_support_and_a_directorys_own_helpers_are_allowed(tmp_path: Path):
    root = _tree(tmp_path, {
        "tests/b/test_two.py": "from tests.support.tools import X\n"
                               "from tests.support import tools\n",
        "tests/a/test_two.py": "from .helper import Y\nfrom tests.a.helper import Y as Y2\n",
        "tests/a/test_three.py": "import os\nimport pytest\n",
    })
    assert violations(root) == []
