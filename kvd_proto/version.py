"""The version of kvd (the daemon, the client library and the wire shelf ship as one
distribution): pyproject.toml states it, once; this reads it back.

From a checkout (an editable install or the directory on the path) the file itself is read,
so a changed version shows without reinstalling; an installed wheel has no pyproject.toml
beside its packages and answers from its metadata instead.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

DISTRIBUTION = "kvd-offload"
UNKNOWN = "0+unknown"       # neither a checkout nor installed (a copy of the packages alone)


def _version() -> str:
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text())["project"]
    except (OSError, ValueError, KeyError):
        project = {}
    if project.get("name") == DISTRIBUTION and "version" in project:
        return str(project["version"])
    # Imported here: importlib.metadata costs a checkout's `kvd --help` ~15 ms for nothing.
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return UNKNOWN


__version__ = _version()
