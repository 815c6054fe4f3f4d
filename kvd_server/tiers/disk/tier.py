"""The local disk tier: blocks the pool evicts, kept on a local drive (NVMe) under the pool.

Files, in the configured directory: `kvd-disk.data` (preallocated to the tier's size, read
and written with O_DIRECT where the filesystem allows it, in slots aligned to 4 KiB:
kvd_server/tiers/disk/space.py), `kvd-disk.journal` (the tier's index:
kvd_server/tiers/disk/journal.py) and `kvd-disk.lock` (one daemon per directory).

A demotion copies the block into an aligned buffer at once (the pool slot may be reused as
soon as `demote` returns), then one of the tier's I/O threads writes it and computes its
CRC-32; the index records it only once it is written. A promotion reads the block on an I/O
thread, checks its CRC-32 and copies it into the caller's buffer: a corrupt or torn block is
dropped and counted, never served. The I/O threads take the blocks in batches once they fall
behind (kvd_server/tiers/disk/io_batches.py), each batch written or read in one call that holds no
GIL (kvd_server/tiers/disk/block_io.py) and journaled in one write. The buffers in flight are
bounded (`queue_bytes`): past it demotions are refused (counted), so the pool never waits for
the disk.

A missing or read-only directory, a full disk or an I/O error degrades the tier (one WARNING,
counted, `kvd health` says so): it refuses demotions for `retry_s`, then tries again; the pool
and the engines carry on without it. A directory the daemon may not write at start (read-only,
no permission) is opened for reading only: the tier serves what it holds, refuses demotions,
and tries for writing again every `retry_s`. A directory removed under the daemon (`rm -rf`) is
noticed on the housekeeping thread's tick (the files' link counts, the directory's and the lock
file's identity): its blocks are forgotten, its files closed (their space freed: nothing is
written into files nobody can find) and its lock let go (another daemon may take the path);
after `retry_s` the tier opens the path again, as at start.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kvd_server.tiers.base import HELD_ALREADY, Tier, TierHealth, TierKey, TierStats
from kvd_server.tiers.disk import block_io
from kvd_server.tiers.disk.buffers import AlignedBuffers
from kvd_server.tiers.disk.files import (
    DATA_FILE,
    JOURNAL_FILE,
    LOCK_FILE,
    FileIds,
    OpenFiles,
    OpenRefused,
    open_files,
)
from kvd_server.tiers.disk.io_batches import IoBatches
from kvd_server.tiers.disk.journal import Journal, Placed
from kvd_server.tiers.disk.space import DiskSpace, Entry, State, aligned

__all__ = ["DATA_FILE", "JOURNAL_FILE", "LOCK_FILE", "DiskTier"]

log = logging.getLogger(__name__)

DEFAULT_EXTENT_BYTES = 64 << 20
DEFAULT_IO_THREADS = 4
DEFAULT_QUEUE_BYTES = 256 << 20
RETRY_S = 30.0                  # a degraded tier tries again after this long (the default)
FLUSH_S = 1.0                   # the journal is fsynced this often (when it changed)
CANCELLED = -errno.ECANCELED    # an I/O result: not done, the tier is closing

_REASONS = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded",
            errno.EROFS: "read-only filesystem", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied", errno.EIO: "I/O error",
            errno.ENOENT: "directory missing"}


def _reason(exc: OSError) -> str:
    if isinstance(exc, OpenRefused):
        return exc.reason
    return f"{_REASONS.get(exc.errno or 0, 'error')}: {exc.strerror or exc}"


_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)   # may still be opened for reading


def _placed(entry: Entry) -> Placed:
    """A block as the journal records it."""
    return Placed(entry.offset, entry.length, entry.alloc, entry.crc, entry.key.namespace,
                  entry.key.key, entry.key.tenant)


def _page_aligned(view: memoryview) -> bool:
    """Whether a writable buffer starts on a page (what O_DIRECT needs)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view)) % mmap.PAGESIZE == 0
    except (TypeError, ValueError):
        return False


class DiskTier(Tier):
    """One directory's disk tier (see the module doc); a tier of this node alone (the
    optional capabilities are `Tier`'s defaults)."""

    name = "disk"

    def __init__(self, directory: str, size: int, *, extent_bytes: int = DEFAULT_EXTENT_BYTES,
                 io_threads: int = DEFAULT_IO_THREADS, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 quota_of: Callable[[str], int] | None = None, open_now: bool = True,
                 retry_s: float = RETRY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`open_now=False` opens the files on the tier's own thread (the daemon: preallocating
        the data file and replaying the journal must not delay serving); until then, and
        while degraded, demotions are refused."""
        if size < extent_bytes:
            raise ValueError(f"disk tier size {size} is smaller than one extent "
                             f"({extent_bytes} bytes)")
        self.directory = os.path.abspath(directory)
        self.size = size // extent_bytes * extent_bytes
        self.extent_bytes = extent_bytes
        self.queue_bytes = queue_bytes
        self.retry_s = retry_s
        self._quota_of = quota_of
        self._clock = clock
        self._lock = threading.Lock()
        self._space = DiskSpace(self.size, extent_bytes, quota_of)
        self._stats = TierStats(self.name, health=TierHealth.OPENING, capacity_bytes=self.size,
                                directory=self.directory)
        self.on_dropped: Callable[[list[TierKey]], None] | None = None   # evicted, corrupt
        self._in_flight = 0              # bytes of buffers in flight
        self._retry_at = 0.0
        self._reads_fail_until = 0.0
        self.direct = False
        self.read_only = False           # opened for reading only: serves, takes no demotion
        self._fd = self._lock_fd = -1    # set (under the lock) only once the tier is open
        self._ids: FileIds | None = None
        self._journal: Journal | None = None
        # Batches using a data file descriptor now, and descriptors let go of meanwhile
        # (the directory removed, opened again for writing): closed only once no batch uses
        # one, so a descriptor number is never reused under a batch's reads and writes.
        self._fd_users = 0
        self._retired: list[int] = []
        # Reads (promotions: an engine waits on them) never queue behind write-behind
        # demotions (up to queue_bytes of them): each has its own threads.
        self._io = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="kvd-disk-write")
        self._reads = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="kvd-disk-read")
        # Handed to those threads in batches once they fall behind (kvd_server/tiers/
        # io_batches.py): a busy tier pays the GIL and a journal write once per batch.
        # (what comes after the tier closed its threads ends unwritten / unread: cancelled)
        self._writes: IoBatches[tuple[Entry, mmap.mmap, Future[bool]]] = IoBatches(
            self._io, self._write_batch, io_threads,
            cancel=lambda b: self._write_batch(b, cancelled=True))
        self._read_batches: IoBatches[tuple[Entry, memoryview, Future[bool]]] = IoBatches(
            self._reads, self._read_batch, io_threads,
            cancel=lambda b: self._read_batch(b, cancelled=True))
        self._buffers = AlignedBuffers(queue_bytes)
        if not block_io.NATIVE:
            log.warning("disk tier %s: its block I/O runs on the pure-Python twin (kvd_server."
                        "_blockio was not built, or KVD_NATIVE=0): slower under load",
                        self.directory)
        self._closed = threading.Event()
        if open_now:
            self._try_open()
        self._flusher = threading.Thread(target=self._flush_loop, name="kvd-disk-flush",
                                         daemon=True)
        self._flusher.start()

    # ------------------------------------------------------------------- files
    def _try_open(self) -> None:
        """Open, preallocate and replay (kvd_server/tiers/disk/files.py; off the daemon's
        event loop), then install it under the lock: demotions see either no tier or a whole
        one. A directory it may not write is opened for reading only; degraded when neither
        can be."""
        try:
            files = open_files(self.directory, self.size, self.extent_bytes, self._quota_of)
        except OSError as exc:
            read_only = self._open_read_only(exc)
            if read_only is None:
                with self._lock:
                    self._degrade(_reason(exc))
                return
            self._install(read_only, f"{_reason(exc)}: opened read-only, serving what it holds")
            return
        self._install(files, "")

    def _open_read_only(self, why: OSError) -> OpenFiles | None:
        """The files opened for reading, where `why` (opening them for writing failed) says
        the directory may not be written; None when that was not why, or they cannot be."""
        if isinstance(why, OpenRefused) or why.errno not in _READ_ONLY:
            return None
        try:
            return open_files(self.directory, self.size, self.extent_bytes, self._quota_of,
                              read_only=True)
        except OSError as exc:
            log.debug("disk tier %s: not opened read-only either: %s", self.directory, exc)
            return None

    def _install(self, files: OpenFiles, read_only: str) -> None:
        """Under the lock: the tier's files are these (`read_only`: why they were opened for
        reading only, its degraded reason; "" when writable)."""
        with self._lock:
            if self._closed.is_set():        # closed while they were opened: let them go
                self._close_files(files.data_fd, files.lock_fd, files.journal)
                return
            self._space, self._journal, self.direct = files.space, files.journal, files.direct
            self._lock_fd, self._fd, self._ids = files.lock_fd, files.data_fd, files.ids
            self.read_only = files.read_only
            st = self._stats
            if not read_only:
                if st.health is TierHealth.DEGRADED:
                    log.info("disk tier %s: open again (was degraded: %s)", self.directory,
                             st.reason)
                st.health, st.reason = TierHealth.OK, ""
                return
            log.warning("disk tier %s: %s (%d blocks); demotions refused, opened for writing "
                        "again once it can be (tried every %.0fs)", self.directory, read_only,
                        len(self._space.entries), self.retry_s)
            st.health, st.reason = TierHealth.DEGRADED, read_only
            self._retry_at = self._clock() + self.retry_s

    def _try_writable(self) -> None:
        """A tier opened read-only, once its directory may be written again: its files opened
        for writing under the lock it holds, the blocks it serves kept as they are (the
        journal told of those it dropped meanwhile)."""
        with self._lock:
            self._retry_at = self._clock() + self.retry_s
            lock_fd = self._lock_fd
        try:
            os.close(os.open(os.path.join(self.directory, LOCK_FILE),
                             os.O_WRONLY | os.O_CLOEXEC))
            files = open_files(self.directory, self.size, self.extent_bytes, self._quota_of,
                               lock_fd=lock_fd)
        except OSError as exc:
            log.debug("disk tier %s: still not writable: %s", self.directory, exc)
            return
        with self._lock:
            if self._closed.is_set() or not self.read_only or self._lock_fd != lock_fd:
                self._close_files(files.data_fd, -1, files.journal)
                return
            live = {e.offset for e in self._space.entries.values() if not e.dropped}
            self._retire(self._fd)
            self._fd, self._journal, self.direct = files.data_fd, files.journal, files.direct
            self._ids, self.read_only = files.ids, False
            for offset in files.space.entries:
                if offset not in live:
                    self._journal_delete_at(offset)
            log.info("disk tier %s: writable again (was %s): demotions taken", self.directory,
                     self._stats.reason)
            self._stats.health, self._stats.reason = TierHealth.OK, ""

    def _close_files(self, data_fd: int, lock_fd: int, journal: Journal | None) -> None:
        """Let go of files opened for nothing (the tier closed or changed meanwhile)."""
        if journal is not None:
            with contextlib.suppress(OSError):
                journal.close()
        for fd in (data_fd, lock_fd):
            if fd >= 0:
                os.close(fd)

    # ------------------------------------------- descriptors in use, removed directories
    def _take_fd(self) -> int:
        """Under the lock: the data file's descriptor for a batch (-1: none, not open), held
        open until `_give_fd`."""
        if self._fd >= 0:
            self._fd_users += 1
        return self._fd

    def _give_fd(self, fd: int) -> None:
        """Under the lock: a batch is done with `fd`; descriptors let go of meanwhile are
        closed once no batch uses one."""
        if fd < 0:
            return
        self._fd_users -= 1
        if self._fd_users == 0:
            while self._retired:
                os.close(self._retired.pop())

    def _retire(self, fd: int) -> None:
        """Under the lock: close `fd` (no longer the tier's) now, or once the batches using a
        descriptor end."""
        if fd < 0:
            return
        if self._fd_users:
            self._retired.append(fd)
        else:
            os.close(fd)

    def _check_files(self) -> None:
        """On the housekeeping thread (the only one that opens or closes the tier's files, so
        it may look at them unlocked): whether the files are still the directory's. When they
        are not (removed, `rm -rf`), give them up."""
        with self._lock:
            fd, lock_fd, ids = self._fd, self._lock_fd, self._ids
            journal_fd = self._journal.fileno() if self._journal is not None else -1
        if fd < 0 or ids is None:
            return
        gone = self._files_gone(fd, lock_fd, journal_fd, ids)
        if gone:
            kept = self._blocks_kept()
            with self._lock:
                if self._fd == fd:
                    self._give_up(gone, kept)

    def _files_gone(self, fd: int, lock_fd: int, journal_fd: int, ids: FileIds) -> str:
        """Why the open files are no longer the directory's ("" while they are): a few
        fstat/stat calls, once a second. An error other than "not there" (EIO on a dead
        drive) is not a verdict: the reads and writes say what that is."""
        lock_path = os.path.join(self.directory, LOCK_FILE)
        unlinked = []
        try:
            if os.fstat(fd).st_nlink == 0:
                unlinked.append(DATA_FILE)
            if journal_fd >= 0 and os.fstat(journal_fd).st_nlink == 0:
                unlinked.append(JOURNAL_FILE)
            try:
                same_lock = os.path.samestat(os.stat(lock_path), os.fstat(lock_fd))
            except (FileNotFoundError, NotADirectoryError):
                same_lock = False
            if not same_lock:
                unlinked.append(LOCK_FILE)
            try:
                st = os.stat(self.directory)
                same_dir = (st.st_dev, st.st_ino) == ids.directory
            except (FileNotFoundError, NotADirectoryError):
                same_dir = False
        except OSError:
            return ""
        if not same_dir:
            return f"directory removed: {self.directory} was removed while in use"
        if unlinked:
            return (f"files removed: {', '.join(unlinked)} removed from {self.directory} "
                    "while in use")
        return ""

    def _blocks_kept(self) -> bool:
        """After `_files_gone`: whether the data file and the journal are still there (only
        the lock went): opening the path again finds the blocks again."""
        names = {DATA_FILE, JOURNAL_FILE}
        try:
            return names <= set(os.listdir(self.directory))
        except OSError:
            return False

    def _give_up(self, reason: str, kept: bool) -> None:
        """Under the lock: the files are gone from the directory: forget their blocks (told:
        their removed events go out, engines stop naming them), close them (an unlinked
        file's space is freed once its last descriptor closes; nothing more is written into
        it) and let go of the lock (another daemon may take the path); the tier is degraded
        and opens the path again after retry_s. `kept`: only the lock went, the blocks are
        found again then."""
        doomed = [e for e in self._space.entries.values() if not e.dropped]
        fate = ("let go (found again when the path is opened again)" if kept
                else "lost with its files, which are closed (their space freed)")
        log.warning("disk tier %s: %s: its %d blocks are %s and the path given up (another "
                    "daemon may take it); the pool carries on without the tier, which tries "
                    "the path again in %.0fs", self.directory, reason, len(doomed), fate,
                    self.retry_s)
        journal, self._journal = self._journal, None
        if journal is not None:
            with contextlib.suppress(OSError):
                journal.close()
        for entry in doomed:
            self._drop(entry)            # the journal gone: nothing written for them
        self._retire(self._fd)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
        self._fd = self._lock_fd = -1
        self._ids, self.read_only = None, False
        st = self._stats
        st.health, st.reason = TierHealth.DEGRADED, reason
        self._retry_at = self._clock() + self.retry_s
        self._tell_dropped([e.key for e in doomed])

    def _idle(self) -> bool:
        """Under the lock: no demotion or promotion queued or running (the files may be
        opened anew: no batch of the old ones is left)."""
        return self._in_flight == 0 and self._stats.queue_depth == 0 and self._fd_users == 0

    # ----------------------------------------------------------------- health
    def _degrade(self, reason: str) -> None:
        """Under the lock: refuse demotions for RETRY_S (an unopened tier: open again then)."""
        st = self._stats
        if st.health is not TierHealth.DEGRADED or st.reason != reason:
            log.warning("disk tier %s degraded (%s): demotions refused for %.0fs; the pool "
                        "carries on without it", self.directory, reason, self.retry_s)
        st.health, st.reason = TierHealth.DEGRADED, reason
        self._retry_at = self._clock() + self.retry_s

    def _usable(self) -> bool:
        """Under the lock: whether demotions are taken now."""
        st = self._stats
        if self._fd < 0 or self._closed.is_set() or self.read_only:
            return False                   # not open (yet, or any more): the flusher opens
        # Degraded past RETRY_S: tried again (the health is OK again once a write succeeds).
        return st.health is not TierHealth.DEGRADED or self._clock() >= self._retry_at

    @property
    def readable(self) -> bool:
        """Whether promotions are worth starting: open, and no read failed with an I/O error
        in the last RETRY_S (a dead disk: each would only evict a pool block for nothing)."""
        return self._fd >= 0 and self._clock() >= self._reads_fail_until

    # ---------------------------------------------------------------- queries
    def contains(self, key: TierKey) -> bool:
        entry = self._space.get(key)
        return entry is not None and entry.state is State.READY and not entry.dropped

    def keys(self, namespace: str) -> list[bytes]:
        with self._lock:
            return [k.key for k, e in self._space.by_key.items()
                    if k.namespace == namespace and e.state is State.READY and not e.dropped]

    # ------------------------------------------------------------- demotion
    def demote(self, key: TierKey, data: memoryview | bytes) -> Future[bool] | None:
        length = len(data)
        st = self._stats
        with self._lock:
            existing = self._space.get(key)
            if existing is not None:
                if existing.state is State.READY:
                    self._space.touch(existing)
                    return HELD_ALREADY
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
        buf = self._buffers.take(entry.alloc)
        block_io.copy_into(buf, data)   # the GIL let go meanwhile: the I/O threads run
        if entry.alloc > length:        # the padding: never another block's bytes on disk
            buf[length:] = bytes(entry.alloc - length)
        future: Future[bool] = Future()
        self._writes.add((entry, buf, future))
        return future

    def _write_batch(self, batch: list[tuple[Entry, mmap.mmap, Future[bool]]],
                     cancelled: bool = False) -> None:
        """On an I/O thread: write a batch of demotions (kvd_server/tiers/disk/block_io.py), then
        record the written ones in the index and the journal (one write for the batch).
        `cancelled`: the tier is closing: none is written (not a failure)."""
        with self._lock:
            fd = -1 if cancelled else self._take_fd()
        t0 = time.perf_counter()
        try:
            results = [CANCELLED] * len(batch) if fd < 0 else block_io.write_blocks(
                fd, [(buf, e.offset, e.length) for e, buf, _ in batch])
        except Exception:  # a bug, not the disk: the blocks are lost, the tier goes on
            log.exception("disk tier %s: a batch of writes failed", self.directory)
            results = [-errno.EIO] * len(batch)
        seconds = time.perf_counter() - t0
        for _, buf, _ in batch:
            self._buffers.give(buf)
        st = self._stats
        good = [False] * len(batch)
        with self._lock:
            self._give_fd(fd)
            st.write_seconds_total += seconds
            for i, ((entry, _, _), result) in enumerate(zip(batch, results, strict=True)):
                self._in_flight -= entry.alloc
                st.queue_depth -= 1
                if result < 0 or entry.dropped or self._journal is None:
                    self._space.release(entry)
                    if result < 0 and result != CANCELLED:
                        st.failures_total += 1
                        self._degrade(_reason(block_io.error(result)))
                    continue
                self._space.ready(entry, result)
                good[i] = True
            written = [e for (e, _, _), ok in zip(batch, good, strict=True) if ok]
            if not self._journal_written(written):
                good = [False] * len(batch)
        for (_, _, future), ok in zip(batch, good, strict=True):
            future.set_result(ok)

    def _journal_written(self, written: list[Entry]) -> bool:
        """Under the lock: journal the blocks a batch wrote, all of them, or (False) none when
        the journal cannot be written: then they are released and the tier degrades."""
        if not written or self._journal is None:
            return True
        st = self._stats
        try:
            self._journal.put_many(list(map(_placed, written)))
        except OSError as exc:
            for entry in written:
                self._space.release(entry)
            st.failures_total += 1
            self._degrade(_reason(exc))
            return False
        st.demotions_total += len(written)
        st.demoted_bytes_total += sum(e.length for e in written)
        if st.health is TierHealth.DEGRADED:
            log.info("disk tier %s: writing again (was degraded: %s)", self.directory, st.reason)
            st.health, st.reason = TierHealth.OK, ""
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
        self._journal_delete_at(entry.offset)

    def _journal_delete_at(self, offset: int) -> None:
        """Under the lock: a DEL record (none while read-only: the drop lasts until the
        daemon stops, or the journal is told once it may be written again)."""
        if self._journal is not None and not self.read_only:
            try:
                self._journal.delete(offset)
            except OSError as exc:
                self._stats.failures_total += 1
                self._degrade(_reason(exc))

    # ------------------------------------------------------------- promotion
    def promote(self, key: TierKey, dest: memoryview) -> Future[bool] | None:
        st = self._stats
        with self._lock:
            entry = self._space.get(key)
            if entry is None or entry.state is not State.READY or entry.dropped \
                    or self._fd < 0 or self._closed.is_set():
                st.misses_total += 1
                return None
            if len(dest) < entry.length:
                raise ValueError(f"promotion into {len(dest)} bytes of a {entry.length}-byte "
                                 "block")
            entry.readers += 1
            self._space.touch(entry)
            st.queue_depth += 1
        future: Future[bool] = Future()
        self._read_batches.add((entry, dest, future))
        return future

    def _read_batch(self, batch: list[tuple[Entry, memoryview, Future[bool]]],
                    cancelled: bool = False) -> None:
        """On an I/O thread: read a batch of promotions, then settle each (whatever happens,
        every promotion of the batch ends: a failure reads as an I/O error). `cancelled`:
        the tier is closing: none is read (each fails, the blocks kept)."""
        with self._lock:
            fd = -1 if cancelled else self._take_fd()
        t0 = time.perf_counter()
        try:
            results = [CANCELLED] * len(batch) if fd < 0 else \
                self._read_all(fd, [(entry, dest) for entry, dest, _ in batch])
        except Exception:  # a bug or no memory for a buffer, not the disk: the tier goes on
            log.exception("disk tier %s: a batch of reads failed", self.directory)
            results = [-errno.EIO] * len(batch)
        seconds = time.perf_counter() - t0
        with self._lock:
            self._give_fd(fd)
            self._stats.read_seconds_total += seconds
            good = [self._read_done(entry, result)
                    for (entry, _, _), result in zip(batch, results, strict=True)]
        for (_, _, future), ok in zip(batch, good, strict=True):
            future.set_result(ok)

    def _read_all(self, fd: int, reads: list[tuple[Entry, memoryview]]) -> list[int]:
        """Each block checked against its CRC-32 (`read_blocks`), read straight into its
        destination (a pool slot: page-aligned, its stride covers the padding) where it can
        take the whole aligned read, else through a buffer."""
        items: list[block_io.ReadItem] = []
        bufs: list[mmap.mmap] = []
        try:
            for entry, dest in reads:
                if len(dest) >= entry.alloc and _page_aligned(dest):
                    items.append((dest[:entry.alloc], entry.offset, entry.length, entry.crc,
                                  None))
                else:
                    bufs.append(self._buffers.take(entry.alloc))
                    items.append((bufs[-1], entry.offset, entry.length, entry.crc, dest))
            return block_io.read_blocks(fd, items)
        finally:
            for item in items:
                if isinstance(item[0], memoryview):
                    item[0].release()
            for buf in bufs:
                self._buffers.give(buf)

    def _read_done(self, entry: Entry, result: int) -> bool:
        """Under the lock: a promotion's read ended (`read_blocks`' result); whether it was
        good. A corrupt or torn block is dropped (and told), never served."""
        st = self._stats
        st.queue_depth -= 1
        entry.readers -= 1
        if result == CANCELLED:                  # the tier is closing: kept, not read
            if entry.dropped and entry.readers == 0:
                self._journal_delete(entry)
                self._space.release(entry)
            return False
        if result < 0:
            st.failures_total += 1
            self._reads_fail_until = self._clock() + self.retry_s
            self._degrade(_reason(block_io.error(result)))       # one WARNING per reason
        elif result == 0:
            st.corrupt_total += 1
            log.warning("disk tier %s: a block failed its checksum: dropped, not served",
                        self.directory)
        if result != 1 and not entry.dropped:
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
            return dataclasses.replace(st)

    # -------------------------------------------------------------- lifecycle
    def _flush_loop(self) -> None:
        """The tier's housekeeping thread: opens the files (at start and again after a failed
        open, every RETRY_S), fsyncs and compacts the journal, lets idle buffers go."""
        while not self._closed.is_set():
            self._check_files()
            with self._lock:
                due = self._clock() >= self._retry_at and self._idle()
                closed, read_only = self._fd < 0, self.read_only
            if due and closed:
                self._try_open()
            elif due and read_only:
                self._try_writable()
            self._flush()
            self._buffers.trim()
            self._closed.wait(FLUSH_S)

    def _flush(self) -> None:
        with self._lock:
            journal = self._journal
            if journal is None:
                return
            try:
                if journal.needs_compaction(len(self._space.entries)):
                    journal.compact(_placed(e) for e in self._space.entries.values()
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
        self._reads.shutdown(wait=True)
        self._buffers.close()
        self._flusher.join(timeout=5)
        self._flush()
        with self._lock:
            if self._journal is not None:
                try:
                    self._journal.close()
                except OSError as exc:
                    log.warning("disk tier %s: closing its journal: %s", self.directory, exc)
                self._journal = None
            for fd in (self._fd, self._lock_fd, *self._retired):
                if fd >= 0:
                    os.close(fd)
            self._fd = self._lock_fd = -1
            self._retired.clear()

