"""Counters the fault tests add to as they run, printed at the end of the run (`make soak`).

Every number is measured by the test that records it (rounds actually run, cases actually
tried, divergences and leaks actually counted), so the summary line is evidence, not a claim.
"""

from __future__ import annotations

from collections import Counter

COUNTS: Counter[str] = Counter()
# What the summary always shows (zeros included), in this order.
ORDER = ("crash rounds", "crash points", "fuzz cases", "load clients", "load steps",
         "isolation checks", "bound checks", "stall checks", "divergences", "leaks",
         "torn blocks", "daemon crashes")


def record(name: str, n: int = 1) -> None:
    COUNTS[name] += n


def render(failed: int) -> str:
    parts = [f"{name} {COUNTS.get(name, 0)}" for name in ORDER]
    parts += [f"{name} {n}" for name, n in sorted(COUNTS.items()) if name not in ORDER]
    return "kvd fault summary: " + ", ".join(parts) + f", failed tests {failed}"
