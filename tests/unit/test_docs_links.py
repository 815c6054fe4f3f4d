"""The repository stands alone: no file of it points at a path outside it, and every relative
link of its Markdown pages leads to a file (and heading) that exists.

Whoever reads a clone has only the clone: a link to a folder beside the author's checkout or
into the author's workspace is a dead end for them (issue 22, item 6).
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve()
# Folders a clone does not hold (what .gitignore lists), for a tree that is not a git checkout.
NOT_CLONED = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache",
              ".ruff_cache", ".hypothesis", ".benchmarks", "node_modules", "tmp"}
MAX_FILE_BYTES = 4 << 20        # larger files are data, not prose a reader follows
# A path that climbs: `../x/y.md`, `../../shared`.
CLIMB = re.compile(r"(?<![\w.~/-])((?:\.\./)+[\w.-]*(?:/[\w.-]+)*)")
# Absolute paths into the workspace a checkout sits in (here: /work/<checkout>, /work/shared).
WORKSPACES = tuple(dict.fromkeys(["/work/"] + ([str(ROOT.parent).rstrip("/") + "/"]
                                               if ROOT.parent != Path("/") else [])))
ABSOLUTE = re.compile(r"(?<![\w.~-])(/[\w.-]+(?:/[\w.$-]+)*/?)")

# References out of the repository in files this change may not edit: each must go, and then
# its entry here too (the test fails while an entry no longer matches anything).
PENDING: dict[tuple[str, str], str] = {}


@cache
def repo_files() -> tuple[Path, ...]:
    """What a clone holds: git's tracked files and untracked ones it does not ignore; without
    git, every file outside the folders a clone does not have."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=ROOT, capture_output=True,
                             check=True, timeout=60)
        files = [ROOT / name for name in out.stdout.decode().split("\0") if name]
    except (OSError, subprocess.SubprocessError):
        files = [p for p in ROOT.rglob("*")
                 if not NOT_CLONED.intersection(p.relative_to(ROOT).parts)
                 and not any(part.endswith(".egg-info") for part in p.parts)]
    return tuple(sorted(p for p in files if p.is_file() and p.resolve() != SELF))


def prose(path: Path) -> str | None:
    """The text of `path` a reader follows: for Python its comments and docstrings (string
    literals in code are data, e.g. a fuzz case), for other text files all of it; None for
    binary or oversized files."""
    if path.stat().st_size > MAX_FILE_BYTES:
        return None
    data = path.read_bytes()
    if b"\0" in data:
        return None
    text = data.decode("utf-8", errors="replace")
    if path.suffix != ".py":
        return text
    parts = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                parts.append(tok.string)
        tree = ast.parse(text)
    except (SyntaxError, tokenize.TokenError):
        return text   # not parseable: judge all of it
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def _leaves_repo(start: Path, token: str) -> bool:
    target = (start / token).resolve()
    return target != ROOT and ROOT not in target.parents


def outside_references() -> dict[tuple[str, str], str]:
    """(file, token) -> why, for every reference out of the repository.

    A climbing path counts when read from its own file's folder it leaves the repository, or
    when read from the repository's root (as comments and scripts run from there read it) it
    leaves it and read from its own folder it names nothing.
    """
    found: dict[tuple[str, str], str] = {}
    for path in repo_files():
        text = prose(path)
        if text is None:
            continue
        name = path.relative_to(ROOT).as_posix()
        for token in CLIMB.findall(text):
            token = token.rstrip(".")
            if _leaves_repo(path.parent, token):
                found[(name, token)] = f"{token} leads out of the repository from {name}"
            elif _leaves_repo(ROOT, token) and not (path.parent / token).exists():
                folder = path.parent.relative_to(ROOT).as_posix()
                found[(name, token)] = (f"{token} leads out of the repository (read from its "
                                        f"root) and to no file from {folder}/")
        for token in ABSOLUTE.findall(text):
            if token.startswith(WORKSPACES):
                found[(name, token)] = f"{token} is a path in the workspace, not in the repo"
    return found


def test_the_scan_sees_the_repository():
    names = {p.relative_to(ROOT).as_posix() for p in repo_files()}
    assert {"README.md", "Makefile", "docs/internals.md", "kvd_server/cli/main.py",
            "deploy/systemd/kvd.service"} <= names, "repo_files() misses the repository"
    assert not any(n.startswith((".venv/", ".git/")) for n in names)


def test_the_scan_catches_what_it_is_for(tmp_path: Path):
    """The patterns find the kinds of reference issue 22 found (guards against a regex that
    matches nothing)."""
    text = ("Read with `../shared/DESIGN.md`; see /work/shared/DESIGN.md and "
            "[x](../../elsewhere.md) but not ./docs/x.md, /run/kvd/kvd.sock or https://a/b.")
    assert CLIMB.findall(text) == ["../shared/DESIGN.md", "../../elsewhere.md"]
    assert [t for t in ABSOLUTE.findall(text) if t.startswith(WORKSPACES)] == \
        ["/work/shared/DESIGN.md"]
    module = tmp_path / "m.py"
    module.write_text('"""Doc: ../up.md"""\n# a comment: ../c.md\nFUZZ = "../../etc/passwd"\n')
    assert sorted(CLIMB.findall(prose(module) or "")) == ["../c.md", "../up.md"]


def test_no_file_refers_to_a_path_outside_the_repository():
    found = outside_references()
    new = {key: why for key, why in found.items() if key not in PENDING}
    assert not new, "files refer outside the repository (a clone has only itself):\n" + \
        "\n".join(f"  {file}: {why}" for (file, _), why in sorted(new.items()))
    fixed = sorted(set(PENDING) - set(found))
    assert not fixed, f"no longer found, remove from PENDING: {fixed}"


# --- Markdown links ---------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_pages() -> list[Path]:
    return [p for p in repo_files() if p.suffix == ".md"]


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) outside fenced code blocks, code spans blanked."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation out, spaces to
    hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(path):
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline link, image and reference definition of a page."""
    out = []
    for number, line in _prose_lines(path):
        out += [(number, t) for t in INLINE_LINK.findall(line)]
        ref = REFERENCE_DEF.match(line)
        if ref:
            out.append((number, ref.group(1)))
    return out


def broken_links(path: Path) -> list[str]:
    out = []
    name = path.relative_to(ROOT).as_posix()
    for number, link in links(path):
        if not link or SCHEME.match(link):
            continue   # a URL or mailto: not a file of the repository
        target, _, anchor = link.partition("#")
        where = f"{name}:{number}: ({link})"
        dest = (path.parent / target).resolve() if target else path
        if dest != ROOT and ROOT not in dest.parents:
            out.append(f"{where} leads out of the repository")
        elif not dest.exists():
            out.append(f"{where} names no file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{where} names no heading of {dest.relative_to(ROOT).as_posix()}")
    return out


def test_the_link_parser_reads_what_pages_write():
    assert slug("The reserve: sized from the store rate") == "the-reserve-sized-from-the-store-rate"
    assert slug("`KvdClient` reference") == "kvdclient-reference"
    assert slug("Why a daemon, not the engine's own offload?") == \
        "why-a-daemon-not-the-engines-own-offload"
    line = 'See [a](docs/a.md), ![i](x.png "t"), [c](b.md#sec) and `[no](code.md)`.'
    assert INLINE_LINK.findall(CODE_SPAN.sub("", line)) == ["docs/a.md", "x.png", "b.md#sec"]


def test_readme_and_docs_link_every_page_they_should():
    """The pages the issue names are where a reader starts: they exist and link."""
    pages = {p.relative_to(ROOT).as_posix() for p in markdown_pages()}
    assert {"README.md", "docs/design.md", "docs/internals.md"} <= pages
    readme = {t.partition("#")[0] for _, t in links(ROOT / "README.md")}
    assert "docs/design.md" in readme, "README's docs table has no row for docs/design.md"
    internals = {t.partition("#")[0] for _, t in links(ROOT / "docs" / "internals.md")}
    assert "design.md" in internals, "docs/internals.md does not link design.md"


def test_every_relative_markdown_link_resolves():
    pages = markdown_pages()
    assert ROOT / "README.md" in pages and len(pages) > 5
    broken = [b for page in pages for b in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)
