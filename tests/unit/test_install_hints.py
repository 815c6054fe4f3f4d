"""Every install hint names kvd's own distribution: `kvd-offload` (or a checkout, `./kvd[...]`).

The `kvd` on the package index is an unrelated project (README, "Install"), so a hint such as
`pip install 'kvd[cluster]'` in a doc, an error or a log line installs someone else's code.
This test reads every tracked text file of the tree (docs, code, deploy files, tests' own
skip reasons) and fails on such a hint, naming the file and line.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
SUFFIXES = {".md", ".py", ".toml", ".txt", ".sh", ".yaml", ".yml", ".cfg", ".c", ".h", ".json",
            ".service", ".proto", ""}
SKIP_PARTS = {"results"}      # bench/results/: measurements, not instructions


def _extras() -> list[str]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    return sorted(extras, key=len, reverse=True)


def _bad_hints() -> re.Pattern[str]:
    """`kvd[extra]` not preceded by a path (`./kvd[vllm]` is a checkout: fine), and a bare
    `pip install kvd`."""
    extras = "|".join(map(re.escape, _extras()))
    name = "kvd"        # spelt apart so that this file does not match itself
    return re.compile(rf"(?<![\w./~-]){name}\[(?:{extras})(?:,\s*(?:{extras}))*\]"
                      rf"|pip3? install\s+['\"]?{name}(?![\w./\[-])")


def _tree() -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    files = []
    for rel in out.stdout.splitlines():
        path = ROOT / rel
        if (path.suffix in SUFFIXES and path.is_file() and not SKIP_PARTS & set(path.parts)
                and path != pathlib.Path(__file__).resolve()):
            files.append(path)
    return files


def test_the_pattern_finds_the_wrong_hints_and_spares_the_right_ones():
    bad = _bad_hints()
    assert bad.search("pip install 'kvd" + "[cluster]'")
    assert bad.search("run: pip install kvd" + "[cuda] first")
    assert bad.search("pip install kv" + "d")
    assert not bad.search("pip install './kvd[vllm]'")            # a checkout at ./kvd
    assert not bad.search("pip install 'kvd-offload[cluster]'")
    assert not bad.search('env = {e["name"]: e["value"] for e in kvd["env"]}')


def test_no_install_hint_names_the_unrelated_kvd_package():
    bad = _bad_hints()
    found = []
    for path in _tree():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if bad.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, ("install hints that name the unrelated `kvd` package (the distribution "
                       "is kvd-offload: `pip install 'kvd-offload[EXTRA]'` where kvd is "
                       "installed, `pip install './kvd[EXTRA]'` from a checkout):\n"
                       + "\n".join(found))
