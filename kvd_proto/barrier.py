"""The full memory barrier both shared-memory protocols need (the index and the channel).

A process that publishes a word another process reads (an engine's reclaim mark, a ring's
tail, a freed slot) and then reads a word that process publishes (the index, the reader
marks, the daemon's idle flag) needs its store visible before its load: a full barrier.
CPython has no atomics; an uncontended lock's acquire is a locked read-modify-write
instruction, which is one on x86-64 (the platform kvd ships for). One definition, so the
engine and the daemon fence the same way.
"""

from __future__ import annotations

import threading

_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier: the stores before it are visible before the loads after it."""
    _FENCE.acquire()
    _FENCE.release()
