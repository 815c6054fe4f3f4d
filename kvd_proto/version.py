"""The version of kvd (the daemon, the client library and the wire shelf ship as one
distribution): pyproject.toml states it, once; this reads it back.

From a checkout (an editable install or the directory on the path) the file itself is read,
so a changed version shows without reinstalling; an installed wheel has no pyproject.toml
beside its packages and answers from its metadata instead: the name of its .dist-info
directory, else importlib.metadata (which reads every installed distribution's metadata: a
start of `kvd serve` paid ~45 ms for it).
"""

from __future__ import annotations

import os
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
    installed = _installed_version(pyproject.parent)
    if installed:
        return installed
    # Imported here: importlib.metadata costs a checkout's `kvd --help` ~15 ms for nothing,
    # and an installed `kvd serve` ~45 ms (it reads every distribution's metadata).
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return UNKNOWN


def _installed_version(site: Path) -> str:
    """The version an installed wheel names its metadata directory with
    (`kvd_offload-<version>.dist-info`, beside the packages); "" unless exactly one is
    there."""
    prefix = DISTRIBUTION.replace("-", "_") + "-"
    try:
        found = [entry.name for entry in os.scandir(site)
                 if entry.name.startswith(prefix) and entry.name.endswith(".dist-info")]
    except OSError:
        return ""
    return found[0][len(prefix):-len(".dist-info")] if len(found) == 1 else ""


__version__ = _version()
