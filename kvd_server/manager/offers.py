"""Offer counting for vLLM's `store_threshold`: a block is stored only once it was offered
that many times (reuse is likely then), as vLLM 0.33's CPU manager does. The counts are kept
for the most recently offered keys only (`max_keys`, oldest first out), and an offer never
evicts its own keys' counts."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class OfferCounts:
    def __init__(self, threshold: int, max_keys: int) -> None:
        self.threshold = threshold
        self.max_keys = max_keys
        self._offers: OrderedDict[bytes, int] = OrderedDict()

    def count(self, keys: Sequence[bytes]) -> None:
        """One more offer of each of `keys`."""
        offers = self._offers
        seen = set()
        for key in keys:
            if key in offers:
                offers.move_to_end(key)
                offers[key] += 1
                seen.add(key)
        unprotected = len(offers) - len(seen)
        for key in keys:
            if key in offers:
                continue
            if len(offers) >= self.max_keys:
                if unprotected == 0:
                    continue
                offers.popitem(last=False)
                unprotected -= 1
            offers[key] = 1

    def due(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys offered at least `threshold` times."""
        offers, threshold = self._offers, self.threshold
        return [k for k in keys if offers.get(k, 0) >= threshold]
