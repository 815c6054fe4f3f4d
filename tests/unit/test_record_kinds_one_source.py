"""The channel's record kinds are defined once for C (kvd_proto/_records.h) and once for Python
(kvd_proto/record_kinds.py), held equal here, and defined nowhere else: a kind numbered again in
another C file or Python module would drift from these the day one of them changes."""

from __future__ import annotations

import re
from pathlib import Path

from kvd_proto import record_kinds

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "kvd_proto" / "_records.h"
DEFINE = re.compile(r"^#define KIND_(\w+) +(\d+)\b", re.M)


def test_the_header_and_python_number_every_kind_alike() -> None:
    in_c = {name: int(value) for name, value in DEFINE.findall(HEADER.read_text())}
    in_python = {**{name.upper(): kind for kind, name in record_kinds.UP_KINDS.items()},
                 **{name.upper(): kind for kind, name in record_kinds.DOWN_KINDS.items()}}
    assert in_c == in_python
    for name, kind in in_python.items():
        assert getattr(record_kinds, name) == kind


def test_no_other_file_numbers_a_kind_again() -> None:
    again = []
    for path in sorted((ROOT / "kvd_proto").glob("*.c")) + sorted((ROOT / "kvd_proto").glob("*.h")):
        if path != HEADER and DEFINE.search(path.read_text()):
            again.append(path.name)
    python_kind = re.compile(r"^\w*KIND\w* = \d+", re.M)
    for package in ("kvd_proto", "kvd_client", "kvd_server"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name != "record_kinds.py" and python_kind.search(path.read_text()):
                again.append(path.relative_to(ROOT).as_posix())
    assert not again, f"record kinds defined again in: {', '.join(again)}"
