"""Store admission by offer count (vLLM's `store_threshold`), engine-side and engine-neutral.

A block is worth a slot and a copy only if it is likely to be read again. vLLM's CPU manager
guesses that from how often the scheduler offered it: a block offered fewer than `threshold`
times is not stored. kvd applies the same rule in the engine, before the session takes slots,
so a skipped offer costs no slot, no record and no daemon work. The counts are local, on the
scheduler thread, and bounded: the most recently offered `max_keys` keys (oldest out first; an
offer never evicts the counts of its own keys, so an offer larger than the bound still makes
progress). Blocks already stored (or being stored) are never skipped: the threshold applies to
new stores only, exactly as in vLLM 0.33's `CPUOffloadingManager.prepare_store`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

DEFAULT_MAX_KEYS = 64_000          # vLLM's default `max_tracker_size`
MAX_KEYS_LIMIT = 1 << 22           # about 0.6 GiB of counts at most (an OrderedDict entry
                                   # and a 40-byte key take about 150 bytes)
MAX_THRESHOLD = 1 << 20

NewKeys = Callable[[list[bytes]], Iterable[bytes]]


def _count_option(config: Mapping[str, Any], name: str, default: int, low: int,
                  high: int) -> int:
    """An integer option, as vLLM reads it (`int(value)`), with a clear error for junk."""
    value = config.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | str | float):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if not low <= n <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {n}")
    return n


def admission_options(config: Mapping[str, Any]) -> tuple[int, int]:
    """(store_threshold, max_tracker_size) from an engine's config, with vLLM's names and
    defaults (0: no filter; 64000). Raises ValueError naming the option for a bad value."""
    threshold = _count_option(config, "store_threshold", 0, 0, MAX_THRESHOLD)
    max_keys = _count_option(config, "max_tracker_size", DEFAULT_MAX_KEYS, 1, MAX_KEYS_LIMIT)
    return threshold, max_keys


class OfferCounter:
    """Counts offers per key and admits the keys offered `threshold` times (see the module
    doc). `skipped` counts the new keys held back, since construction."""

    __slots__ = ("_counts", "max_keys", "skipped", "threshold")

    def __init__(self, threshold: int, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if not 2 <= threshold <= MAX_THRESHOLD:
            raise ValueError(f"store_threshold must be between 2 and {MAX_THRESHOLD} for a "
                             f"filter, got {threshold} (below 2 no filter is needed)")
        if not 1 <= max_keys <= MAX_KEYS_LIMIT:
            raise ValueError(f"max_tracker_size must be between 1 and {MAX_KEYS_LIMIT}, "
                             f"got {max_keys}")
        self.threshold = threshold
        self.max_keys = max_keys
        self.skipped = 0
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._counts)

    def count(self, key: bytes) -> int:
        """How many offers of `key` are remembered (0: none, or aged out)."""
        return self._counts.get(key, 0)

    def admit(self, keys: list[bytes], new_keys: NewKeys) -> list[bytes]:
        """Count one offer of each of `keys`; return them without the new ones offered fewer
        than `threshold` times. `new_keys(candidates)` says which of the candidates are not
        stored nor being stored (it is asked only about keys below the threshold)."""
        counts = self._counts
        protected: set[bytes] = set()
        for key in keys:
            n = counts.get(key)
            if n is not None:
                counts.move_to_end(key)
                counts[key] = n + 1
                protected.add(key)
        # Keys counted before this offer are at the end now: only older ones make room.
        unprotected = len(counts) - len(protected)
        limit = self.max_keys
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= limit:
                if unprotected == 0:
                    continue
                counts.popitem(last=False)
                unprotected -= 1
            counts[key] = 1
        threshold = self.threshold
        cold = [k for k in keys if counts.get(k, 0) < threshold]
        if not cold:
            return keys
        held = set(new_keys(cold))
        if not held:
            return keys
        admitted = [k for k in keys if k not in held]
        self.skipped += len(keys) - len(admitted)
        return admitted

    def clear(self) -> None:
        """Forget every count (the skipped total stays: it is a counter)."""
        self._counts.clear()
