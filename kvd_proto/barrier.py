"""The full memory barrier both shared-memory protocols need (the index and the channel).

A process that publishes a word another process reads (an engine's reclaim mark, a ring's
tail, a freed slot) and then reads a word that process publishes (the index, the reader
marks, the daemon's idle flag) needs its store visible before its load: a full barrier.
CPython has no atomics: kvd_proto._native's `fence` is one (a sequentially consistent
fence); where it was not built (or `KVD_NATIVE=0`), an uncontended lock's acquire, a locked
read-modify-write instruction, which is one on x86-64 (the platform kvd ships for). One
definition, so the engine and the daemon fence the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvd_proto.native import compiled

_FENCE = threading.Lock()


def py_fence() -> None:
    """A full memory barrier: the stores before it are visible before the loads after it."""
    _FENCE.acquire()
    _FENCE.release()


_native = compiled("kvd_proto._native")
fence: Callable[[], None] = getattr(_native, "fence", py_fence)
