"""Imports read from source, for the tests that hold the house's plan against the code
(tests/unit/test_import_graph.py: the packages' modules and folders; test_test_layout.py: where
the tests' helpers live). Every import counts, wherever it stands (inside a function, under
TYPE_CHECKING) and however it is spelled (absolute, relative, `from package import module`)."""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    """The dotted name of the module at `path` under `root` (a package by its __init__)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[int, str, str]]:
    """(line, module imported, the import as written) for each import in `path` (module
    `name`) of a module in `modules`; an import of a name inside a module counts as an import
    of that module."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: list[tuple[int, str, str]] = []
    seen: set[tuple[int, str]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here[:len(here) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from package import module` imports the module; `from module import name`
            # imports the module.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]      # `import a.b.c` where c is a name
            if target and target != name and (node.lineno, target) not in seen:
                seen.add((node.lineno, target))
                out.append((node.lineno, target, ast.unparse(node)))
    return out
