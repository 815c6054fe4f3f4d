"""Opening the disk tier's files: the lock (one daemon per directory), the data file
(preallocated, O_DIRECT where the filesystem allows) and the journal (replayed into the
tier's space). Runs on the tier's own thread at start; whatever was opened is closed again when
a step fails, and a failed preallocation gives the drive its space back.
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
from kvd_server.tiers.disk.journal import Journal, JournalMismatch
from kvd_server.tiers.disk.space import DiskSpace
from kvd_server.units import format_size

log = logging.getLogger(__name__)

DATA_FILE = "kvd-disk.data"
JOURNAL_FILE = "kvd-disk.journal"
LOCK_FILE = "kvd-disk.lock"


@dataclass(slots=True)
class OpenFiles:
    lock_fd: int
    data_fd: int
    direct: bool
    journal: Journal
    space: DiskSpace


def open_files(directory: str, size: int, extent_bytes: int,
               quota_of: Callable[[str], int] | None) -> OpenFiles:
    """The tier's files in `directory`, opened, with the blocks its journal holds (OSError
    when they cannot be: the caller degrades the tier)."""
    fds: list[int] = []
    journal: Journal | None = None
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        lock_fd = os.open(os.path.join(directory, LOCK_FILE),
                          os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fds.append(lock_fd)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(errno.EBUSY, f"another kvd daemon uses {directory}") from None
        fd, direct = open_data(os.path.join(directory, DATA_FILE), size)
        fds.append(fd)
        journal = Journal(os.path.join(directory, JOURNAL_FILE), size, extent_bytes)
        try:
            placed = journal.load()
        except JournalMismatch as why:
            log.warning("disk tier %s: its journal was %s; starting empty", directory, why)
            os.unlink(journal.path)
            placed = journal.load()
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
    log.info("disk tier %s: %s, %d blocks (%s) kept from before, %s I/O", directory,
             format_size(size), kept, format_size(space.used_bytes),
             "direct" if direct else "buffered (no O_DIRECT here)")
    return OpenFiles(lock_fd, fd, direct, journal, space)


def open_data(path: str, size: int) -> tuple[int, bool]:
    """The data file, preallocated: (its descriptor, whether it does direct I/O). The
    benchmarks open their raw files with it too, so they measure the same kind of file."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    try:
        fd, direct = os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:     # a filesystem without direct I/O (tmpfs)
            raise
        fd, direct = os.open(path, flags, 0o600), False
    try:
        before = os.fstat(fd).st_size
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
                raise
    except BaseException:
        os.close(fd)
        raise
    return fd, direct
