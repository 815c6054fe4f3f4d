"""The shared index of a namespace (the daemon writes it, engines read it) and the epoch-based
reuse of the slots it frees.

Engines answer lookups from this index without a round trip (layout: kvd_proto/index_layout).
A slot a lookup found READY must stay untouched while the engine copies out of it, without a
synchronous pin: every reading session publishes, in a small marks file of its own, the oldest
reclaim epoch it may still act on; the daemon raises the reclaim epoch after freeing slots and
reuses a freed slot only once every reader (and every ended reader whose process lives on)
has published an epoch past it. A reader that stalls holds back reuse in its namespace; it
never reads a reused slot. Such a reader is named (`Reclamation.holder`: kvd stats,
ListSessions) and, once it has held writers back for HOLD_WARN_S, warned about in the log.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvd_proto.barrier import fence
from kvd_proto.index_layout import (
    FIRST_RECLAIM_EPOCH,
    GENERATION_SHIFT,
    HEADER_BYTES,
    MARKS_BYTES,
    RECLAIM_EPOCH_OFFSET,
    RESET_EPOCH_OFFSET,
    STATE_FREE,
    STATE_MASK,
    Header,
    buckets_for,
)
from kvd_proto.native import IndexTable

log = logging.getLogger(__name__)

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
HOLD_WARN_S = 5.0       # a freed slot held back this long: its holder is named in a WARNING
WARN_EVERY_S = 60.0     # at most one such warning per namespace this often


def sealed_shared_file(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A memfd of `size` bytes mapped read/write here, then sealed: engines map it read-only
    (no write through their descriptor or a new mapping, no size change, no further seal).
    The daemon's own mapping stays writable."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK
                    | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except OSError:
        os.close(fd)
        raise
    return fd, mapping


class ShmIndex:
    """The namespace's index in a memory file; `fd` is handed to its engines (read-only)."""

    def __init__(self, capacity: int, key_width: int, per_extent: int, stride: int,
                 extent_bytes: int, name: str = "kvd-index", *, private: bool = False,
                 path: str | None = None, adopt: bool = False, create: bool = True) -> None:
        """A new index: in a sealed memfd (default), in anonymous memory (`private`), or in
        the file `path` (warm restart: it outlives the daemon; a new file unless `create` is
        False, for a memory file systemd keeps, named /proc/self/fd/N). With `adopt`, the
        existing file at `path` is taken over as it is (ValueError when it is not an index of
        this geometry): its keys, states and epochs are the previous daemon's."""
        self.header = Header(capacity=capacity, buckets=buckets_for(capacity),
                             key_width=key_width, per_extent=per_extent, stride=stride,
                             extent_bytes=extent_bytes)
        h = self.header
        self.name = name            # kvd-index-<namespace id prefix>: the log names it
        self.path = path
        if private:
            # Nobody else reads it (a manager without engines: tests, benchmarks): anonymous
            # memory, no descriptor to hand out or to leak.
            self.fd = -1
            self._map = mmap.mmap(-1, h.file_bytes)
        elif path is not None:
            self.fd, self._map = _index_file(path, h, adopt, create)
        else:
            self.fd, self._map = sealed_shared_file(name, h.file_bytes)
        if not adopt:
            self._map[:len(h.pack())] = h.pack()
        view = memoryview(self._map)
        self._meta = view[h.meta_offset:h.meta_offset + 8 * h.capacity].cast("Q")
        self._epochs = view[RESET_EPOCH_OFFSET:RECLAIM_EPOCH_OFFSET + 8].cast("Q")
        # The reclaim epoch starts at 1: a reader publishes the epoch it sees before its first
        # lookup, and a published 0 means "nothing read yet" (Reclamation.floor skips it), so
        # an epoch of 0 would leave a fresh namespace's first readers holding nothing.
        if not adopt or self.reclaim_epoch < FIRST_RECLAIM_EPOCH:
            self.reclaim_epoch = FIRST_RECLAIM_EPOCH
        self._width = h.key_width
        # find / insert / remove / key_of: compiled where built (kvd_proto/native.py)
        self._table = IndexTable(self._map, *h.geometry)

    # -- epochs
    @property
    def reset_epoch(self) -> int:
        return self._epochs[0]

    @reset_epoch.setter
    def reset_epoch(self, value: int) -> None:
        self._epochs[0] = value

    @property
    def reclaim_epoch(self) -> int:
        return self._epochs[1]

    @reclaim_epoch.setter
    def reclaim_epoch(self, value: int) -> None:
        self._epochs[1] = value

    # -- slots
    def fits(self, key: bytes) -> bool:
        return len(key) <= self._width

    def insert(self, slot: int, key: bytes) -> bool:
        """Publish `key` as being stored in `slot`; False when it cannot be indexed (too long,
        or no free bucket within MAX_PROBE): readers then never see it, which is safe."""
        return self._table.insert(slot, key)

    @property
    def overflows_total(self) -> int:
        return self._table.overflows

    def set_ready(self, slot: int) -> None:
        """A slot being stored becomes readable (same generation: a reader's memo holds)."""
        self._table.set_ready(slot)

    def remove(self, slot: int) -> None:
        """Unpublish `slot` (meta first, then its bucket; backward-shift deletion)."""
        self._table.remove(slot)

    def clear(self) -> None:
        """Unpublish every slot (a reset): meta words first, then the buckets."""
        meta = np.frombuffer(self._meta, dtype="<u8", count=self.header.capacity)
        used = (meta & STATE_MASK) != STATE_FREE
        meta[used] = ((meta[used] >> GENERATION_SHIFT) + 1) << GENERATION_SHIFT
        start = self.header.buckets_offset
        end = start + 4 * self.header.buckets
        zeros = bytes(1 << 20)
        for off in range(start, end, len(zeros)):
            n = min(len(zeros), end - off)
            self._map[off:off + n] = zeros[:n]

    def state(self, slot: int) -> int:
        return self._meta[slot] & STATE_MASK

    def meta_array(self) -> np.ndarray:
        """Every slot's meta word (a view, for one vectorised pass: adoption)."""
        return np.frombuffer(self._meta, dtype="<u8", count=self.header.capacity)

    def buckets_array(self) -> np.ndarray:
        """The buckets (slot id + 1, 0 empty), a view."""
        h = self.header
        return np.frombuffer(self._map, dtype="<u4", count=h.buckets,
                             offset=h.buckets_offset)

    def keys_array(self) -> np.ndarray:
        """Every slot's key bytes, one row per slot (a view)."""
        h = self.header
        return np.frombuffer(self._map, dtype=np.uint8, count=h.capacity * h.key_width,
                             offset=h.keys_offset).reshape(h.capacity, h.key_width)

    def find(self, key: bytes) -> int:
        """The slot `key` is published in (storing or ready), or -1: the daemon's own key ->
        slot lookup (the index is its only key store)."""
        return self._table.find(key)

    def find_function(self):  # noqa: ANN201 - a bound method of the native or Python table
        """`find` itself, one call less for the daemon's per-key loops."""
        return self._table.find

    def set_ready_function(self):  # noqa: ANN201 - likewise
        return self._table.set_ready

    def key_of_function(self):  # noqa: ANN201 - likewise
        return self._table.key_of

    def insert_function(self):  # noqa: ANN201 - likewise
        return self._table.insert

    def remove_function(self):  # noqa: ANN201 - likewise
        return self._table.remove

    def key_of(self, slot: int) -> bytes:
        """The key published in `slot` (empty when none is)."""
        return self._table.key_of(slot)

    def reachable(self, slots: np.ndarray) -> np.ndarray:
        """Per slot, whether a lookup of the key it holds finds that very slot (compiled
        where built: a warm restart checks every adopted block this way)."""
        found = self._table.reachable(np.ascontiguousarray(slots, dtype=np.int64).tobytes())
        return np.frombuffer(found, dtype=np.uint8).astype(bool)

    def close(self) -> None:
        self._table.release()
        for view in (self._meta, self._epochs):
            view.release()
        try:
            self._map.close()
        except BufferError:       # a numpy view of it still lives: the GC unmaps it
            log.debug("index %s mapping still exported; left to the GC", self.name)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _index_file(path: str, header: Header, adopt: bool, create: bool = True
                ) -> tuple[int, mmap.mmap]:
    """(a read-only descriptor for engines, the daemon's read/write mapping) of the index
    file at `path`: a new one (never an existing file; with `create` False, the empty or
    right-sized file there), or with `adopt` the existing one, checked against `header`. A
    regular file cannot be sealed against writes; its engines get a read-only descriptor
    instead, which can neither write it nor change its size."""
    flags = os.O_RDWR | os.O_CLOEXEC
    if not path.startswith("/proc/self/fd/"):
        flags |= os.O_NOFOLLOW
    rw = os.open(path, flags if adopt or not create else flags | os.O_CREAT | os.O_EXCL,
                 0o600)
    try:
        st = os.fstat(rw)
        if adopt:
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise ValueError(f"{path} is not a regular file of uid {os.geteuid()}")
            if st.st_size != header.file_bytes:
                raise ValueError(f"{path} has {st.st_size} bytes, an index of this "
                                 f"namespace's geometry {header.file_bytes}")
        elif st.st_size != header.file_bytes:
            os.ftruncate(rw, header.file_bytes)
        mapping = mmap.mmap(rw, header.file_bytes, mmap.MAP_SHARED,
                            mmap.PROT_READ | mmap.PROT_WRITE)
        if adopt:
            try:
                found = Header.unpack(mapping[:HEADER_BYTES])
            except ValueError as exc:
                mapping.close()
                raise ValueError(f"{path}: {exc}") from None
            if found != header:
                mapping.close()
                raise ValueError(f"{path} is an index of another geometry ({found}, "
                                 f"expected {header})")
        ro = os.open(path, (flags & ~os.O_RDWR) | os.O_RDONLY)
    finally:
        os.close(rw)
    return ro, mapping


class ReaderMarks:
    """A session's marks file: it writes the oldest reclaim epoch it may still act on."""

    def __init__(self, session_id: str) -> None:
        self.fd = os.memfd_create(f"kvd-marks-{session_id}", os.MFD_CLOEXEC
                                  | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, MARKS_BYTES)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    | fcntl.F_SEAL_SEAL)
        self._map = mmap.mmap(self.fd, MARKS_BYTES, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = memoryview(self._map)[0:8].cast("Q")

    @property
    def published(self) -> int:
        return self._view[0]

    def close(self) -> None:
        self._view.release()
        self._map.close()
        os.close(self.fd)


@dataclass(slots=True, frozen=True)
class ReclaimHolder:
    """The reader whose published epoch holds back the reuse of a namespace's oldest freed
    slots: an idle or stopped engine stalls every writer of its namespace, so it is named."""

    session_id: str
    pid: int                # its process (0: not known)
    live: bool              # False: its session ended while its process lives on
    published_epoch: int
    waiting_epoch: int      # what the oldest freed slot waits for
    slots_waiting: int      # freed slots not reusable yet
    held_seconds: float     # since the oldest freed slot was freed


class Reclamation:
    """Freed slots wait in limbo, tagged with the reclaim epoch raised after their free, until
    every reader has published that epoch or a later one."""

    def __init__(self, index: ShmIndex, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self.clock = clock
        self.readers: dict[str, ReaderMarks] = {}
        self.held: dict[str, int] = {}          # ended readers whose process lives on
        self._pids: dict[str, int] = {}         # readers and held readers -> their process
        self._pending: list[int | np.ndarray] = []
        self._pending_count = 0
        # (epoch, slots, when sealed, how many): the seal time says how long a holder has held
        # them. An item of `slots` is a slot, or a run of them retired whole (retire_run).
        self._limbo: deque[tuple[int, list[int | np.ndarray], float, int]] = deque()
        self.in_limbo = 0
        self._warn_after = 0.0                  # no warning before this (rate limit)

    @property
    def active(self) -> bool:
        return bool(self.readers or self.held)

    def retire(self, slot: int) -> None:
        self._pending.append(slot)
        self._pending_count += 1
        self.in_limbo += 1          # from now: whether sealed yet must not change what counts

    def retire_many(self, slots: list[int]) -> None:
        self._pending.extend(slots)
        self._pending_count += len(slots)
        self.in_limbo += len(slots)

    def retire_run(self, slots: np.ndarray) -> None:
        """Retire `slots` as one item: `collect` gives the array back whole (a warm restart's
        idle slots of an adopted extent: never a Python int each)."""
        self._pending.append(slots)
        self._pending_count += len(slots)
        self.in_limbo += len(slots)

    def hold(self, session_id: str, pid: int, epoch: int) -> None:
        """An ended reader whose process may still act on epochs up to `epoch` (a reader of
        the previous daemon, after a warm restart): held like one ended here."""
        self.held[session_id] = max(FIRST_RECLAIM_EPOCH, epoch)
        self._pids[session_id] = pid

    def seal(self) -> None:
        """Raise the reclaim epoch past the slots freed since the last seal."""
        if not self._pending:
            return
        epoch = self.index.reclaim_epoch + 1
        self.index.reclaim_epoch = epoch
        self._limbo.append((epoch, self._pending, self.clock(), self._pending_count))
        self._pending = []
        self._pending_count = 0

    def floor(self) -> int | None:
        """The oldest epoch any reader may still act on; None: no reader holds anything."""
        fence()
        marks = [m.published for m in self.readers.values()]
        marks = [m for m in marks if m] + list(self.held.values())
        return min(marks) if marks else None

    def collect(self) -> list[int | np.ndarray]:
        """Slots every reader has moved past: free for reuse (a run retired whole as its
        array)."""
        self.seal()
        if not self._limbo:
            return []
        floor = self.floor()
        out: list[int | np.ndarray] = []
        while self._limbo and (floor is None or self._limbo[0][0] <= floor):
            _, slots, _, count = self._limbo.popleft()
            out.extend(slots)
            self.in_limbo -= count
        if self._limbo:
            self._check_held()
        return out

    def holder(self) -> ReclaimHolder | None:
        """The reader holding back the oldest freed slot (the oldest mark behind it), or None
        when no freed slot waits for anyone."""
        if not self._limbo:
            return None
        waiting, _, since, _ = self._limbo[0]
        fence()
        marks = [(m.published, sid, True) for sid, m in self.readers.items()]
        marks += [(epoch, sid, False) for sid, epoch in self.held.items()]
        behind = [m for m in marks if 0 < m[0] < waiting]
        if not behind:
            return None         # collected at the next sweep
        epoch, session_id, live = min(behind)
        return ReclaimHolder(session_id, self._pids.get(session_id, 0), live, epoch, waiting,
                             self.in_limbo, max(0.0, self.clock() - since))

    def _check_held(self) -> None:
        """Warn (rate-limited) when the oldest freed slot has waited HOLD_WARN_S, naming who
        holds it: otherwise writers starve with nothing in the log saying why."""
        now = self.clock()
        if now - self._limbo[0][2] < HOLD_WARN_S or now < self._warn_after:
            return
        h = self.holder()
        if h is None:
            return
        self._warn_after = now + WARN_EVERY_S
        if h.live:
            who, what = "session", ("an engine with no load in flight should publish 0 or the "
                                    "current epoch (docs/attach.md, \"Reclamation\")")
        else:
            who, what = "ended session", ("its process lives on (stopped, or still copying): "
                                          "they come back when it exits or calls ReleaseHeld")
        log.warning("namespace %s: %s %s (pid %d) has held back the reuse of %d freed slots "
                    "for %.0f s (it published reclaim epoch %d, they wait for %d), so writers "
                    "of this namespace may be refused slots: %s. Next warning in %.0f s at the "
                    "earliest", self.index.name.removeprefix("kvd-index-"), who, h.session_id,
                    h.pid, h.slots_waiting, h.held_seconds, h.published_epoch, h.waiting_epoch,
                    what, WARN_EVERY_S)

    def add_reader(self, session_id: str, pid: int = 0) -> ReaderMarks:
        marks = self.readers.get(session_id)
        if marks is None:
            marks = self.readers[session_id] = ReaderMarks(session_id)
            self._pids[session_id] = pid
        return marks

    def end_reader(self, session_id: str, process_lives: bool) -> None:
        """A reading session ended: what it published stays in force while its process may
        still copy (until release_reader)."""
        marks = self.readers.pop(session_id, None)
        if marks is None:
            return
        published = marks.published
        marks.close()
        if process_lives and published:
            self.held[session_id] = published
        else:
            self._pids.pop(session_id, None)

    def release_reader(self, session_id: str) -> bool:
        self._pids.pop(session_id, None)
        return self.held.pop(session_id, None) is not None

    def close(self) -> None:
        for marks in self.readers.values():
            marks.close()
        self.readers.clear()
        self._pids.clear()
