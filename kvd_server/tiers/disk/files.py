"""Opening the disk tier's files: the lock (one daemon per directory), the data file
(preallocated, O_DIRECT where the filesystem allows) and the journal (replayed into the
tier's space). Runs on the tier's own thread at start; whatever was opened is closed again when
a step fails, and a failed preallocation gives the drive its space back.

A directory the daemon may not write (a read-only filesystem, no permission) is opened for
reading only: the lock taken all the same, the data file and the journal read and nothing
written, so the tier still serves the blocks it holds. The lock file names the pid of the
daemon holding it, so a daemon refused the directory says which one has it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from kvd_server.tiers.base import TierKey
from kvd_server.tiers.disk.journal import Journal, JournalMismatch, Placed
from kvd_server.tiers.disk.space import DiskSpace
from kvd_server.units import format_size

log = logging.getLogger(__name__)

DATA_FILE = "kvd-disk.data"
JOURNAL_FILE = "kvd-disk.journal"
LOCK_FILE = "kvd-disk.lock"


class OpenRefused(OSError):
    """The tier's files cannot be used, with the whole reason an operator reads (`kvd stats`,
    the WARNING): another daemon holds them, the filesystem is too small for the tier."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(code, reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class FileIds:
    """What the open files were at open, to notice them removed under the tier: the
    directory's and the lock file's (st_dev, st_ino)."""

    directory: tuple[int, int]
    lock: tuple[int, int]


@dataclass(slots=True)
class OpenFiles:
    lock_fd: int
    data_fd: int
    direct: bool
    journal: Journal
    space: DiskSpace
    ids: FileIds
    read_only: bool = False


def _id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def open_files(directory: str, size: int, extent_bytes: int,
               quota_of: Callable[[str], int] | None, *, read_only: bool = False,
               lock_fd: int = -1) -> OpenFiles:
    """The tier's files in `directory`, opened, with the blocks its journal holds (OSError
    when they cannot be: the caller degrades the tier). `read_only`: open them for reading
    only, nothing written (the journal's damage is skipped, not repaired). `lock_fd`: the
    directory's lock, held already by this tier (opening for writing what it had opened for
    reading): used, not taken again, and left open whatever happens."""
    fds: list[int] = []
    journal: Journal | None = None
    try:
        if not read_only:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        lock_path = os.path.join(directory, LOCK_FILE)
        if lock_fd < 0:
            lock_fd = _lock(directory, lock_path, read_only)
            fds.append(lock_fd)
        if not read_only:
            _write_pid(lock_path, lock_fd)
        ids = FileIds(_id(os.stat(directory)), _id(os.fstat(lock_fd)))
        data_path = os.path.join(directory, DATA_FILE)
        fd, direct = open_data_read_only(data_path, size) if read_only else \
            open_data(data_path, size)
        fds.append(fd)
        journal = Journal(os.path.join(directory, JOURNAL_FILE), size, extent_bytes)
        placed = _replay(directory, journal, read_only)
    except BaseException:
        if journal is not None:
            with contextlib.suppress(OSError):
                journal.close()
        for fd in fds:
            os.close(fd)
        raise
    space = DiskSpace(size, extent_bytes, quota_of)
    kept = sum(space.adopt(TierKey(p.namespace, p.key, p.tenant), p.offset, p.length,
                           p.alloc, p.crc) for p in placed)
    if kept != len(placed):
        log.warning("disk tier %s: %d journal records did not fit the layout; dropped",
                    directory, len(placed) - kept)
    log.info("disk tier %s: %s, %d blocks (%s) kept from before, %s I/O%s", directory,
             format_size(size), kept, format_size(space.used_bytes),
             "direct" if direct else "buffered (no O_DIRECT here)",
             ", read-only" if read_only else "")
    return OpenFiles(lock_fd, fd, direct, journal, space, ids, read_only)


def _replay(directory: str, journal: Journal, read_only: bool) -> list[Placed]:
    """The blocks the journal holds; one of another layout is set aside (removed; read-only:
    left alone, nothing served)."""
    try:
        return journal.load(read_only)
    except JournalMismatch as why:
        if read_only:
            log.warning("disk tier %s: its journal was %s; nothing to serve (read-only)",
                        directory, why)
            return []
        log.warning("disk tier %s: its journal was %s; starting empty", directory, why)
        os.unlink(journal.path)
        return journal.load()


def _lock(directory: str, path: str, read_only: bool) -> int:
    """The directory's lock (flock, exclusive: one daemon per directory, whether it writes or
    only reads), or OpenRefused naming the pid that holds it."""
    flags = os.O_RDONLY if read_only else os.O_RDWR | os.O_CREAT
    fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise OpenRefused(errno.EBUSY,
                          f"another kvd daemon ({holder}) uses {directory}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_pid(path: str, lock_fd: int) -> None:
    """Our pid into the lock file (through a descriptor of our own when the lock's was
    opened for reading: a flock stays with the descriptor that took it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    """"pid N" of the daemon holding the lock, as it wrote it (when that process exists)."""
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.pread(fd, 32, 0).decode(errors="replace").strip())
        with contextlib.suppress(PermissionError):    # another user's process: it exists
            os.kill(pid, 0)
        return f"pid {pid}"
    return "pid unknown"


def open_data(path: str, size: int) -> tuple[int, bool]:
    """The data file, preallocated: (its descriptor, whether it does direct I/O). The
    benchmarks open their raw files with it too, so they measure the same kind of file. A
    filesystem smaller than `size` is said as such (OpenRefused), not as a full disk."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    try:
        fd, direct = os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:     # a filesystem without direct I/O (tmpfs)
            raise
        fd, direct = os.open(path, flags, 0o600), False
    try:
        fs = os.fstatvfs(fd)
        total = fs.f_blocks * fs.f_frsize
        if size > total:
            raise OpenRefused(errno.ENOSPC, "filesystem too small for tiers.disk.size: "
                              f"{format_size(total)} in all, tiers.disk.size is "
                              f"{format_size(size)}")
        st = os.fstat(fd)
        before, had = st.st_size, st.st_blocks * 512
        if before != size:
            os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                # What a failed preallocation took stays allocated (ext4): give the drive's
                # other users their space back.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0 if before != size else before)
                if exc.errno == errno.ENOSPC:
                    free = os.fstatvfs(fd).f_bavail * fs.f_frsize
                    raise OpenRefused(errno.ENOSPC, f"disk full: tiers.disk.size needs "
                                      f"{format_size(size - had)} more than the data file "
                                      f"had, the filesystem has {format_size(free)} free"
                                      ) from exc
                raise
    except BaseException:
        os.close(fd)
        raise
    return fd, direct


def open_data_read_only(path: str, size: int) -> tuple[int, bool]:
    """The data file of a read-only tier: opened for reading (direct where allowed), never
    grown; one shorter than `size` cannot be served from."""
    try:
        fd, direct = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        fd, direct = os.open(path, os.O_RDONLY | os.O_CLOEXEC), False
    have = os.fstat(fd).st_size
    if have < size:
        os.close(fd)
        raise OpenRefused(errno.EINVAL, f"its data file {path} is {format_size(have)}, "
                          f"shorter than tiers.disk.size ({format_size(size)})")
    return fd, direct
