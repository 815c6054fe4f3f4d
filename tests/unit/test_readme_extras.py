"""README's Install section names every extra pyproject.toml defines (it once left out cuda13),
each as `name` followed by what it brings."""

from __future__ import annotations

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_lists_every_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    readme = (ROOT / "README.md").read_text()
    (paragraph,) = [p for p in readme.split("\n\n") if p.startswith("Extras: ")]
    listed = re.findall(r"`([a-z0-9]+)` \(", paragraph)
    assert sorted(listed) == sorted(extras), (listed, sorted(extras))
