"""Human sizes (`64MiB`, `8G`, `64Gi`, `1.5GB`) and durations (`500ms`, `2s`, `1m`).

Config files, env vars and flags all go through these two parsers, so every source accepts the
same spellings and fails with the same messages.

Sizes have one rule: K, M, G and T are powers of 1024 however they are written (`8g`, `8G`,
`8Gi`, `8GiB`, `8GB` are all 8 x 2^30 bytes). kvd sizes memory, and that is what systemd
(`MemoryMax=8G`), Docker (`--memory 8g`), the JVM and Kubernetes' `Gi` mean; a decimal amount
is written as a number of bytes.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
# Every spelling of every power: "", "b", "k", "kb", "ki", "kib", "m", ... (lower case).
_SIZE_UNITS: dict[str, int] = {
    letter + tail: 1024**power
    for letter, power in _POWERS.items()
    for tail in (("", "b") if not letter else ("", "b", "i", "ib"))
}
_DURATION_UNITS: dict[str, Fraction] = {
    "": Fraction(1),
    "ms": Fraction(1, 1000),
    "s": Fraction(1),
    "m": Fraction(60),
    "min": Fraction(60),
    "h": Fraction(3600),
}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Bytes in `value`: an int, or a number with an optional unit (K, M, G, T, each a power
    of 1024, optionally followed by `i` and/or `B`; any case). A fraction must come out to a
    whole number of bytes."""
    if isinstance(value, bool):
        raise ValueError(f"size {value!r} is not a number of bytes")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size {value} is negative")
        return value
    if not isinstance(value, str):
        raise ValueError(f"size {value!r} is not a string or an integer")
    match = _NUMBER_UNIT.match(value)
    if match is None:
        raise ValueError(f"size {value!r} is not a number with an optional unit (e.g. 64MiB)")
    number, unit = match.group(1), match.group(2).lower()
    factor = _SIZE_UNITS.get(unit)
    if factor is None:
        raise ValueError(
            f"size {value!r} has an unknown unit {match.group(2)!r} "
            "(use B, K, M, G or T, powers of 1024: e.g. 512M, 64Gi, 1.5GiB)"
        )
    exact = Fraction(number) * factor
    if exact.denominator != 1:
        raise ValueError(f"size {value!r} is not a whole number of bytes")
    return int(exact)


def format_size(nbytes: int | float) -> str:
    """Short binary form: `64MiB`, `1.5GiB`, `4096B`; exact when the value is a whole unit."""
    nbytes = int(nbytes)
    sign = "-" if nbytes < 0 else ""
    n = abs(nbytes)
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor:
            if n % factor == 0:
                return f"{sign}{n // factor}{unit}"
            return f"{sign}{n / factor:.1f}{unit}"
    return f"{sign}{n}B"


def parse_duration(value: str | int | float) -> float:
    """Seconds in `value`: a number (seconds) or a number with `ms`, `s`, `m`/`min` or `h`."""
    if isinstance(value, bool):
        raise ValueError(f"duration {value!r} is not a number of seconds")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        match = _NUMBER_UNIT.match(value)
        if match is None:
            raise ValueError(f"duration {value!r} is not a number with an optional unit (e.g. 2s)")
        factor = _DURATION_UNITS.get(match.group(2).lower())
        if factor is None:
            raise ValueError(
                f"duration {value!r} has an unknown unit {match.group(2)!r} (use ms, s, m or h)"
            )
        seconds = float(Fraction(match.group(1)) * factor)  # one rounding only
    else:
        raise ValueError(f"duration {value!r} is not a string or a number")
    if seconds < 0 or not math.isfinite(seconds):
        raise ValueError(f"duration {value!r} must be a finite number >= 0")
    return seconds


def format_duration(seconds: float) -> str:
    """Shortest exact form: `500ms`, `2s`, `1m`, `1h`, `1.5s` (parse_duration reads it back)."""
    if seconds == 0:
        return "0s"
    for unit, factor in (("h", 3600.0), ("m", 60.0)):
        if seconds >= factor and (seconds / factor).is_integer():
            return f"{int(seconds / factor)}{unit}"
    if seconds < 1:
        ms = round(seconds * 1000, 9)
        if ms.is_integer() and ms / 1000 == seconds:
            return f"{int(ms)}ms"
    text = repr(float(seconds))
    return (text[:-2] if text.endswith(".0") else text) + "s"
