"""Which blocks the cluster store holds, as far as this node knows: its own and the ones found.

The store is its own directory: every block's name is its namespace and key
(kvd_server/tiers/cluster/names.py), so a node that wants a key asks the store whether it holds
that name. Nodes never tell each other what they published and need no membership: no
manifests, no node list, nothing a node's traffic grows with the number of nodes for.

A key is known here when this node published it (`published`) or asked the store about it and
the store held it (`found`: an engine's lookup missed it, kvd_server/tiers/cluster/tier.py's
`find`); a key the store did not hold is remembered as absent for NEGATIVE_S, so engines
asking again and again cost the store one call, not one a step. A promotion that finds a
known key gone (the store evicted it, its node left, the master restarted) forgets it: a
MISS, never wrong bytes (every block carries its checksum). Both kinds are bounded by
`max_keys` each (the oldest go first); absent keys by MAX_ABSENT.

Thread-safe: the tier's threads and the daemon's event loop call it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable

NEGATIVE_S = 1.0          # a key the store did not hold is not asked about again this long
MAX_ABSENT = 1 << 16      # absent keys remembered (cleared when full: a bound)


class Directory:
    """This node's view of the store's blocks (see the module doc)."""

    def __init__(self, node: str, max_keys: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self.max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._own: dict[str, dict[bytes, None]] = {}      # published here, oldest first
        self._found: dict[str, dict[bytes, None]] = {}    # found by asking, oldest first
        self._absent: dict[tuple[str, bytes], float] = {}   # asked, not held: until when

    def known(self, namespace: str, key: bytes) -> bool:
        with self._lock:
            return key in self._own.get(namespace, ()) or key in self._found.get(namespace, ())

    def mine(self, namespace: str, key: bytes) -> bool:
        with self._lock:
            return key in self._own.get(namespace, ())

    def keys(self, namespace: str) -> list[bytes]:
        with self._lock:
            return list({**self._own.get(namespace, {}), **self._found.get(namespace, {})})

    @property
    def count(self) -> int:
        with self._lock:
            return sum(map(len, self._own.values())) + sum(map(len, self._found.values()))

    def counts(self) -> dict[str, int]:
        """`count` by namespace (what the tier's used bytes are made of)."""
        with self._lock:
            out = {ns: len(keys) for ns, keys in self._own.items() if keys}
            for ns, found in self._found.items():
                if found:
                    out[ns] = out.get(ns, 0) + len(found)
            return out

    def published(self, namespace: str, key: bytes) -> list[bytes]:
        """This node published `key`; the own keys it no longer knows (past max_keys, the
        oldest: they stay in the store until it evicts them, found again when asked for)."""
        with self._lock:
            self._absent.pop((namespace, key), None)
            self._found.get(namespace, {}).pop(key, None)
            return _add(self._own.setdefault(namespace, {}), key, self.max_keys)

    def sample(self, n: int) -> list[tuple[str, bytes]]:
        """Up to n known keys (published here or found), the newest of each (namespace,
        key)."""
        with self._lock:
            out: list[tuple[str, bytes]] = []
            for table in (self._own, self._found):
                for ns, keys in table.items():
                    out += [(ns, k) for k in itertools.islice(reversed(keys), n)]
            return out[-n:]

    def split(self, namespace: str, keys: Iterable[bytes]) -> tuple[list[bytes], list[bytes]]:
        """`keys` (distinct, in order) as (known: published here or found, to ask: neither
        known nor found absent within NEGATIVE_S), in one pass."""
        now = self._clock()
        known: list[bytes] = []
        ask: list[bytes] = []
        with self._lock:
            own, found = self._own.get(namespace, {}), self._found.get(namespace, {})
            absent = self._absent
            for k in dict.fromkeys(keys):
                if k in own or k in found:
                    known.append(k)
                elif absent.get((namespace, k), 0.0) <= now:
                    ask.append(k)
        return known, ask

    def answered(self, namespace: str, asked: list[bytes], held: list[bool]) -> list[bytes]:
        """The store's answer about `asked`: the keys it holds are known from now on (and
        returned), the others absent for NEGATIVE_S."""
        until = self._clock() + NEGATIVE_S
        out = []
        with self._lock:
            found = self._found.setdefault(namespace, {})
            for key, there in zip(asked, held, strict=True):
                if there:
                    _add(found, key, self.max_keys)
                    out.append(key)
                else:
                    if len(self._absent) >= MAX_ABSENT:
                        self._absent.clear()
                    self._absent[(namespace, key)] = until
        return out

    def forget(self, namespace: str, key: bytes) -> None:
        """`key` is gone from the store (a promotion found it missing or corrupt)."""
        with self._lock:
            self._own.get(namespace, {}).pop(key, None)
            self._found.get(namespace, {}).pop(key, None)

    def forget_namespace(self, namespace: str) -> None:
        with self._lock:
            self._own.pop(namespace, None)
            self._found.pop(namespace, None)
            for name in [n for n in self._absent if n[0] == namespace]:
                del self._absent[name]

    def clear(self) -> dict[str, list[bytes]]:
        """Forget everything (the store may have lost it all: a master restarted); what was
        known, by namespace."""
        with self._lock:
            known = {ns: list(keys) for ns, keys in self._own.items()}
            for ns, keys in self._found.items():
                known.setdefault(ns, []).extend(keys)
            self._own.clear()
            self._found.clear()
            self._absent.clear()
            return known


def _add(keys: dict[bytes, None], key: bytes, bound: int) -> list[bytes]:
    """`key` added (as the newest); the oldest dropped past `bound`, returned."""
    keys.pop(key, None)
    keys[key] = None
    dropped = []
    while len(keys) > bound:
        oldest = next(iter(keys))
        del keys[oldest]
        dropped.append(oldest)
    return dropped
