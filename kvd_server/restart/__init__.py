"""Warm restart: the node's cache outlives the daemon process.

With `restart.warm`, everything a block needs lives in files under `restart.directory` (tmpfs
or hugetlbfs, a hostPath in Kubernetes) rather than in the process: every tenant's pool file,
each namespace's shared index (its keys, slot states and epochs), and a small state record
(`state.py`: which namespaces and tenant files exist, and the engine sessions that may still
copy). A new daemon checks those files and adopts them (`adopt.py`): READY blocks are served
again at once, from the same memory; blocks half-stored at the crash are dropped; what the
previous daemon's engines may still read or write is held until they say their copies are
done or their process is gone (`holds.py`). Anything inconsistent is dropped and counted,
never served; files the new daemon cannot serve (another layout version, pool size or extent
size) are replaced by a cold start with one log line saying why.
"""

from kvd_server.restart.state import STATE_VERSION, StateDir

__all__ = ["STATE_VERSION", "StateDir"]
