"""The local disk tier: blocks the pool evicts, kept on a local drive (NVMe) under the pool.

Files, in the configured directory: `kvd-disk.data` (preallocated to the tier's size, read
and written with O_DIRECT where the filesystem allows it, in slots aligned to 4 KiB:
kvd_server/tiers/disk_space.py), `kvd-disk.journal` (the tier's index:
kvd_server/tiers/disk_journal.py) and `kvd-disk.lock` (one daemon per directory).

A demotion copies the block into an aligned buffer at once (the pool slot may be reused as
soon as `demote` returns), then one of the tier's I/O threads writes it and computes its
CRC-32; the index records it only once it is written. A promotion reads the block on an I/O
thread, checks its CRC-32 and copies it into the caller's buffer: a corrupt or torn block is
dropped and counted, never served. The buffers in flight are bounded (`queue_bytes`): past
it demotions are refused (counted), so the pool never waits for the disk.

A missing or read-only directory, a full disk or an I/O error degrades the tier (one WARNING,
counted, `kvd health` says so): it refuses demotions for `RETRY_S`, then tries again; the pool
and the engines carry on without it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kvd_server.tiers.base import TierHealth, TierKey, TierStats
from kvd_server.tiers.disk_journal import Journal, JournalMismatch, Placed
from kvd_server.tiers.disk_space import DiskSpace, Entry, State, aligned

log = logging.getLogger(__name__)

DATA_FILE = "kvd-disk.data"
JOURNAL_FILE = "kvd-disk.journal"
LOCK_FILE = "kvd-disk.lock"
DEFAULT_EXTENT_BYTES = 64 << 20
DEFAULT_IO_THREADS = 4
DEFAULT_QUEUE_BYTES = 256 << 20
RETRY_S = 30.0                  # a degraded tier tries demotions again after this long
FLUSH_S = 1.0                   # the journal is fsynced this often (when it changed)

_REASONS = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded",
            errno.EROFS: "read-only filesystem", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied", errno.EIO: "I/O error",
            errno.ENOENT: "directory missing"}


def _reason(exc: OSError) -> str:
    return f"{_REASONS.get(exc.errno or 0, 'error')}: {exc.strerror or exc}"


def _done(value: bool) -> Future[bool]:
    future: Future[bool] = Future()
    future.set_result(value)
    return future


class DiskTier:
    """One directory's disk tier (see the module doc)."""

    name = "disk"

    def __init__(self, directory: str, size: int, *, extent_bytes: int = DEFAULT_EXTENT_BYTES,
                 io_threads: int = DEFAULT_IO_THREADS, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 quota_of: Callable[[str], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if size < extent_bytes:
            raise ValueError(f"disk tier size {size} is smaller than one extent "
                             f"({extent_bytes} bytes)")
        self.directory = os.path.abspath(directory)
        self.size = size // extent_bytes * extent_bytes
        self.extent_bytes = extent_bytes
        self.queue_bytes = queue_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._space = DiskSpace(self.size, extent_bytes, quota_of)
        self._stats = TierStats(self.name, capacity_bytes=self.size, directory=self.directory)
        self.on_dropped: Callable[[list[TierKey]], None] | None = None   # evicted, corrupt
        self._in_flight = 0              # bytes of buffers in flight
        self._retry_at = 0.0
        self.direct = False
        self._fd = self._lock_fd = -1
        self._journal: Journal | None = None
        self._io = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="kvd-disk")
        self._closed = threading.Event()
        self._try_open()
        self._flusher = threading.Thread(target=self._flush_loop, name="kvd-disk-flush",
                                         daemon=True)
        self._flusher.start()

    # ------------------------------------------------------------------- files
    def _try_open(self) -> bool:
        """Open the tier's files; on failure let go of what was opened and degrade."""
        try:
            self._open()
            return True
        except OSError as exc:
            for fd in (self._fd, self._lock_fd):
                if fd >= 0:
                    os.close(fd)
            self._fd = self._lock_fd = -1
            if self._journal is not None:
                self._journal.close()
                self._journal = None
            self._degrade(_reason(exc))
            return False

    def _open(self) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._lock_fd = os.open(os.path.join(self.directory, LOCK_FILE),
                                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise OSError(errno.EBUSY, f"another kvd daemon uses {self.directory}") from None
        path = os.path.join(self.directory, DATA_FILE)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        try:
            self._fd = os.open(path, flags | os.O_DIRECT, 0o600)
            self.direct = True
        except OSError as exc:
            if exc.errno != errno.EINVAL:     # a filesystem without direct I/O (tmpfs)
                raise
            self._fd = os.open(path, flags, 0o600)
        if os.fstat(self._fd).st_size != self.size:
            os.ftruncate(self._fd, self.size)
        try:
            os.posix_fallocate(self._fd, 0, self.size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        self._journal = Journal(os.path.join(self.directory, JOURNAL_FILE), self.size,
                                self.extent_bytes)
        try:
            placed = self._journal.load()
        except JournalMismatch as why:
            log.warning("disk tier %s: its journal was %s; starting empty", self.directory, why)
            os.unlink(self._journal.path)
            placed = self._journal.load()
        kept = 0
        for p in placed:
            if self._space.adopt(TierKey(p.namespace, p.key, p.tenant), p.offset, p.length,
                                 p.alloc, p.crc):
                kept += 1
        if kept != len(placed):
            log.warning("disk tier %s: %d journal records did not fit the layout; dropped",
                        self.directory, len(placed) - kept)
        self._stats.blocks = kept
        log.info("disk tier %s: %s, %d blocks (%d bytes) kept from before, %s I/O",
                 self.directory, _size(self.size), kept, self._space.used_bytes,
                 "direct" if self.direct else "buffered (no O_DIRECT here)")

    # ----------------------------------------------------------------- health
    def _degrade(self, reason: str) -> None:
        st = self._stats
        if st.health is not TierHealth.DEGRADED or st.reason != reason:
            log.warning("disk tier %s degraded (%s): demotions refused for %.0fs; the pool "
                        "carries on without it", self.directory, reason, RETRY_S)
        st.health, st.reason = TierHealth.DEGRADED, reason
        self._retry_at = self._clock() + RETRY_S

    def _usable(self) -> bool:
        st = self._stats
        if self._fd < 0 or self._closed.is_set():
            if self._fd < 0 and not self._closed.is_set() and self._clock() >= self._retry_at:
                if not self._try_open():
                    return False
                st.health, st.reason = TierHealth.OK, ""
                return True
            return False
        if st.health is TierHealth.DEGRADED:
            if self._clock() < self._retry_at:
                return False
            st.health, st.reason = TierHealth.OK, ""
            log.info("disk tier %s: trying demotions again", self.directory)
        return True

    # ---------------------------------------------------------------- queries
    def contains(self, key: TierKey) -> bool:
        entry = self._space.get(key)
        return entry is not None and entry.state is State.READY and not entry.dropped

    # ------------------------------------------------------------- demotion
    def demote(self, key: TierKey, data: memoryview | bytes) -> Future[bool] | None:
        length = len(data)
        st = self._stats
        with self._lock:
            existing = self._space.get(key)
            if existing is not None:
                if existing.state is State.READY:
                    self._space.touch(existing)
                    return _done(True)
                return None                         # being written already
            if not self._usable() or self._in_flight + aligned(length) > self.queue_bytes:
                st.demotions_refused_total += 1
                return None
            entry, evicted = self._space.allocate(key, length)
            self._dropped(evicted)
            if entry is None:
                st.demotions_refused_total += 1
                return None
            self._in_flight += entry.alloc
            st.queue_depth += 1
        buf = mmap.mmap(-1, entry.alloc)
        buf[:length] = data
        return self._io.submit(self._write, entry, buf)

    def _write(self, entry: Entry, buf: mmap.mmap) -> bool:
        t0 = time.perf_counter()
        try:
            written = os.pwritev(self._fd, [buf], entry.offset)
            if written != entry.alloc:
                raise OSError(errno.EIO, f"short write ({written} of {entry.alloc} bytes)")
            crc = zlib.crc32(memoryview(buf)[:entry.length])
            error = None
        except OSError as exc:
            error = exc
        finally:
            seconds = time.perf_counter() - t0
        buf.close()
        st = self._stats
        with self._lock:
            self._in_flight -= entry.alloc
            st.queue_depth -= 1
            st.write_seconds_total += seconds
            if error is not None or entry.dropped or self._journal is None:
                self._space.release(entry)
                if error is not None:
                    st.failures_total += 1
                    self._degrade(_reason(error))
                return False
            self._space.ready(entry, crc)
            try:
                self._journal.put(Placed(entry.offset, entry.length, entry.alloc, crc,
                                         entry.key.namespace, entry.key.key,
                                         entry.key.tenant))
            except OSError as exc:
                self._space.release(entry)
                st.failures_total += 1
                self._degrade(_reason(exc))
                return False
            st.demotions_total += 1
            st.demoted_bytes_total += entry.length
            return True

    def _dropped(self, entries: list[Entry]) -> None:
        """Entries the space evicted (under the lock): journal their removal."""
        if not entries:
            return
        self._stats.evictions_total += len(entries)
        for entry in entries:
            self._journal_delete(entry)
        self._tell_dropped([e.key for e in entries])

    def _tell_dropped(self, keys: list[TierKey]) -> None:
        """Blocks the tier let go of by itself (the daemon emits their removed events)."""
        if self.on_dropped is not None and keys:
            try:
                self.on_dropped(keys)
            except Exception:  # the tier's bookkeeping must go on whatever the hook does
                log.exception("disk tier: the dropped-blocks hook failed")

    def _journal_delete(self, entry: Entry) -> None:
        if self._journal is not None:
            try:
                self._journal.delete(entry.offset)
            except OSError as exc:
                self._stats.failures_total += 1
                self._degrade(_reason(exc))

    # ------------------------------------------------------------- promotion
    def promote(self, key: TierKey, dest: memoryview) -> Future[bool] | None:
        st = self._stats
        with self._lock:
            entry = self._space.get(key)
            if entry is None or entry.state is not State.READY or entry.dropped \
                    or self._fd < 0:
                st.misses_total += 1
                return None
            if len(dest) != entry.length:
                raise ValueError(f"promotion into {len(dest)} bytes of a {entry.length}-byte "
                                 "block")
            entry.readers += 1
            self._space.touch(entry)
            st.queue_depth += 1
        return self._io.submit(self._read, entry, dest)

    def _read(self, entry: Entry, dest: memoryview) -> bool:
        t0 = time.perf_counter()
        buf = mmap.mmap(-1, entry.alloc)
        error: OSError | None = None
        good = False
        try:
            got = os.preadv(self._fd, [buf], entry.offset)
            view = memoryview(buf)[:entry.length]
            good = got == entry.alloc and zlib.crc32(view) == entry.crc
            if good:
                dest[:] = view
            view.release()
        except OSError as exc:
            error = exc
        finally:
            seconds = time.perf_counter() - t0
            buf.close()
        st = self._stats
        with self._lock:
            st.queue_depth -= 1
            st.read_seconds_total += seconds
            entry.readers -= 1
            if error is not None:
                st.failures_total += 1
                log.warning("disk tier %s: reading a block failed (%s)", self.directory,
                            _reason(error))
            elif not good:
                st.corrupt_total += 1
                log.warning("disk tier %s: a block failed its checksum: dropped, not served",
                            self.directory)
            if not good and not entry.dropped:
                entry.dropped = True
                self._tell_dropped([entry.key])
            if entry.dropped:
                if entry.readers == 0:
                    self._journal_delete(entry)
                    self._space.release(entry)
                return False
            st.hits_total += 1
            st.promotions_total += 1
            st.promoted_bytes_total += entry.length
            return True

    # --------------------------------------------------------------- removal
    def remove(self, key: TierKey) -> bool:
        with self._lock:
            entry = self._space.get(key)
            if entry is None or entry.dropped:
                return False
            self._drop(entry)
            return True

    def remove_namespace(self, namespace: str) -> int:
        with self._lock:
            doomed = [e for k, e in self._space.by_key.items()
                      if k.namespace == namespace and not e.dropped]
            for entry in doomed:
                self._drop(entry)
            return len(doomed)

    def _drop(self, entry: Entry) -> None:
        """Under the lock: forget `entry` now, or when its write or last read ends."""
        entry.dropped = True
        if entry.state is State.READY and entry.readers == 0:
            self._journal_delete(entry)
            self._space.release(entry)
        elif entry.state is State.READY:
            self._journal_delete(entry)      # freed when the last read ends
        # a block still being written is released by _write (never journaled)

    # ------------------------------------------------------------------ stats
    def stats(self) -> TierStats:
        with self._lock:
            st = self._stats
            st.used_bytes = self._space.used_bytes
            st.blocks = len(self._space.entries)
            st.by_tenant_bytes = dict(self._space.tenant_bytes)
            st.direct_io = self.direct
            return TierStats(**{f: getattr(st, f) for f in st.__slots__})

    # -------------------------------------------------------------- lifecycle
    def _flush_loop(self) -> None:
        while not self._closed.wait(FLUSH_S):
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            journal = self._journal
            if journal is None:
                return
            try:
                if journal.needs_compaction(len(self._space.entries)):
                    journal.compact(
                        Placed(e.offset, e.length, e.alloc, e.crc, e.key.namespace, e.key.key,
                               e.key.tenant)
                        for e in self._space.entries.values()
                        if e.state is State.READY and not e.dropped)
                journal.sync()
            except OSError as exc:
                self._stats.failures_total += 1
                self._degrade(_reason(exc))

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._io.shutdown(wait=True)
        self._flusher.join(timeout=5)
        self._flush()
        with self._lock:
            if self._journal is not None:
                try:
                    self._journal.close()
                except OSError as exc:
                    log.warning("disk tier %s: closing its journal: %s", self.directory, exc)
                self._journal = None
            for fd in (self._fd, self._lock_fd):
                if fd >= 0:
                    os.close(fd)
            self._fd = self._lock_fd = -1


def _size(n: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = 1 << {"TiB": 40, "GiB": 30, "MiB": 20, "KiB": 10}[unit]
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} bytes"
