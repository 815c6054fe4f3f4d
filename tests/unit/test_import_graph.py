"""The plan of the house, held against its imports: no module of kvd_proto, kvd_server or
kvd_client imports itself back through others (type-only imports and imports inside functions
count too: a circle a checker or a reader must break is a circle), the folders of each package
stack without a circle, and the top of each package keeps only its few shared modules (the
rest sit in folders named after their concern, docs/internals.md)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from tests.support.imports import imports_of, module_name

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvd_proto", "kvd_server", "kvd_client")
TOP_FILES_AT_MOST = {"kvd_server": 12, "kvd_client": 10}


def _modules() -> dict[str, Path]:
    return {module_name(ROOT, p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {target for _, target, _ in imports_of(name, path, modules)}
            for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _room(module: str) -> str:
    """A module's room: its package's first-level folder, or the module itself when it sits
    at the top of its package (the few shared modules and the daemon's entry)."""
    parts = module.split(".")
    if len(parts) <= 2:
        return module if len(parts) == 2 else parts[0]
    return ".".join(parts[:2])


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    graph = _graph()
    assert len(graph) > 80, f"found only {len(graph)} modules: is ROOT right?"
    cycles = _cycles(graph)
    assert not cycles, "import circles (type-only and function-level imports count):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_folders_stack_without_a_circle():
    rooms: dict[str, set[str]] = defaultdict(set)
    for module, imported in _graph().items():
        if module in PACKAGES:       # a package's own __init__ re-exports; it is no room
            continue
        for target in imported:
            if target in PACKAGES:
                continue
            a, b = _room(module), _room(target)
            if a != b:
                rooms[a].add(b)
    for room in list(rooms):
        for target in list(rooms[room]):
            rooms.setdefault(target, set())
    cycles = _cycles(rooms)
    assert not cycles, "folders that import each other:\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_top_of_each_package_is_small():
    for package, most in TOP_FILES_AT_MOST.items():
        top = sorted(p.name for p in (ROOT / package).glob("*.py"))
        assert len(top) <= most, f"{package}/ holds {len(top)} Python files at its top " \
            f"(at most {most}; the rest belong in folders): {', '.join(top)}"
