"""The code examples of a Markdown page, as the docs tests read and run them: its fenced
blocks (with the language and the `<!-- not-run: REASON -->` marker before each), and the
one-interpreter runner its Python blocks run in, in order. Shared by
tests/multiproc/test_docs_examples.py (which states the conventions for whoever writes the
docs) and the tests that run one page's examples to check what they do
(tests/multiproc/test_client_doc.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.daemon import ROOT

RUN_TIMEOUT = 180.0
FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(\S.*?)\s*-->\s*$")

# `python -c RUNNER`, fed [page, line, code] triples as JSON on stdin: runs them in order in
# one namespace (a later block sees what an earlier one defined).
RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for page, line, code in json.load(sys.stdin):
    # Padded so that a traceback names the page and its own line number.
    exec(compile("\\n" * line + code, page, "exec"), namespace)
"""


@dataclass(frozen=True)
class Example:
    page: str           # path relative to the repository
    line: int           # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None    # the not-run reason, if any

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def examples(path: Path) -> Iterator[Example]:
    """The fenced blocks of one Markdown page (indented fences too, dedented)."""
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = opening.group(1), opening.group(2).lower()
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip() == "```"), None)
        assert end is not None, f"{page}:{i + 1}: a fence that is never closed"
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip()
                for line in lines[i + 1:end]]
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(before)
        yield Example(page, i + 1, lang, "\n".join(body) + "\n",
                      marker.group(1) if marker else None)
        i = end + 1
