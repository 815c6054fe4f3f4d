"""The shared host pool: one memfd (default) or named file, mapped and pre-faulted once.

Engines map the same memory through the file descriptor they receive at attach, so the pool
needs no /dev/shm, hostIPC or shared names. Pre-faulting charges every page to the daemon's
cgroup up front and keeps page faults off the engines' copy path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
PREFAULT_CHUNK = 64 << 20   # bytes per step: keeps progress fine-grained, releases the GIL often
PAGE = mmap.PAGESIZE


class PoolError(Exception):
    """The pool could not be created (the message says why and what to change)."""


def memory_available() -> tuple[int | None, int | None]:
    """(MemAvailable of the machine, room left under this process's cgroup memory.max), in
    bytes; None where unknown or unlimited."""
    machine = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    machine = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    return machine, _cgroup_room()


def _cgroup_room() -> int | None:
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0":          # cgroup v2
            base = Path("/sys/fs/cgroup") / parts[2].lstrip("/")
            try:
                limit = (base / "memory.max").read_text().strip()
                used = int((base / "memory.current").read_text().strip())
            except (OSError, ValueError):
                return None
            return None if limit == "max" else max(0, int(limit) - used)
    return None


def check_fits(size: int) -> None:
    """Refuse a pool the daemon cannot hold in memory (the kernel's OOM killer would end it,
    and maybe another process, while it pre-faults)."""
    machine, cgroup = memory_available()
    limits = [(what, room) for what, room in (("available on this machine (MemAvailable)",
                                               machine),
                                              ("left under the daemon's cgroup memory.max",
                                               cgroup)) if room is not None]
    too_small = [(what, room) for what, room in limits if size > room]
    if too_small:
        from kvd_server.units import format_size

        said = "; ".join(f"{format_size(room)} {what}" for what, room in limits)
        raise PoolError(f"a pool of {format_size(size)} does not fit: {said}. Choose a smaller "
                        "pool.size, or set pool.allow_overcommit = true (--allow-overcommit) "
                        "if the memory will be there")


class HostPool:
    """The daemon's pool: create with `HostPool.create`, then `prefault()`, `close()` on exit."""

    def __init__(self, fd: int, size: int, backing: str, path: str | None, persist: bool,
                 pool_id: str) -> None:
        self.fd = fd
        self.size = size
        self.backing = backing
        self.path = path
        self.persist = persist
        self.pool_id = pool_id
        self.prefaulted_bytes = 0
        self.mlocked = False
        self._map: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED,
                                                mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def create(cls, size: int, backing: str = "memfd", directory: str = "",
               persist: bool = False, name: str = "kvd-pool") -> HostPool:
        """A pool file of `size` bytes (sparse until pre-faulted): an anonymous sealed memfd,
        or `directory/name` for a file-backed pool."""
        if size <= 0:
            raise PoolError(f"pool size must be positive, got {size}")
        size = (size + PAGE - 1) // PAGE * PAGE
        seal = False
        if backing == "memfd":
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            path = None
            pool_id = secrets.token_hex(8)
            seal = True
        elif backing == "file":
            if not directory:
                raise PoolError("pool.backing = \"file\" needs pool.path (a tmpfs or hugetlbfs "
                                "directory)")
            d = Path(directory)
            if not d.is_dir():
                raise PoolError(f"pool directory {directory} does not exist")
            if not os.access(d, os.W_OK):
                raise PoolError(f"pool directory {directory} is not writable by uid {os.getuid()}")
            path = str(d / name)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            pool_id = _file_pool_id(path, persist)
        else:
            raise PoolError(f"unknown pool backing {backing!r}; use \"memfd\" or \"file\"")
        try:
            os.ftruncate(fd, size)
            if seal:
                # Every engine of the tenant gets this descriptor read/write: none of them may
                # shrink the file under the others (SIGBUS) or grow it past the pool.
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                            | fcntl.F_SEAL_SEAL)
            pool = cls(fd, size, backing, path, persist, pool_id)
        except OSError as exc:
            os.close(fd)
            if path and not persist:
                Path(path).unlink(missing_ok=True)
            hint = " (not enough memory or a size limit on the directory)" \
                if exc.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG, errno.EINVAL) else ""
            raise PoolError(f"cannot create a pool of {size} bytes: {exc.strerror}{hint}") from exc
        return pool

    def prefault(self, progress: Callable[[int, int], None] | None = None,
                 stop: threading.Event | None = None) -> bool:
        """Populate every page (MADV_POPULATE_WRITE, else touch a byte per page), in chunks.

        Safe to run in a worker thread: each chunk is one syscall (or a short loop) between
        which the GIL is released. Returns False when `stop` was set before the end (a chunk
        takes well under a second, so a signal is answered within one).
        """
        assert self._map is not None
        done = 0
        populate = True
        while done < self.size:
            if stop is not None and stop.is_set():
                return False
            n = min(PREFAULT_CHUNK, self.size - done)
            if populate:
                try:
                    self._map.madvise(MADV_POPULATE_WRITE, done, n)
                except OSError:
                    populate = False  # kernel < 5.14: fall back to touching pages
            if not populate:
                mv = memoryview(self._map)
                try:
                    for off in range(done, done + n, PAGE):
                        mv[off] = mv[off]
                finally:
                    mv.release()
            done += n
            self.prefaulted_bytes = done
            if progress is not None:
                progress(done, self.size)
        return True

    def mlock(self) -> bool:
        """Lock the pool in RAM; False (logged) when RLIMIT_MEMLOCK or permissions forbid it."""
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        assert self._map is not None
        addr = ctypes.c_void_p.from_buffer(self._map)
        try:
            rc = libc.mlock(ctypes.c_void_p(ctypes.addressof(addr)), ctypes.c_size_t(self.size))
        finally:
            del addr
        if rc != 0:
            err = ctypes.get_errno()
            log.warning("mlock of the %d-byte pool failed: %s; raise RLIMIT_MEMLOCK "
                        "(LimitMEMLOCK=infinity, or the IPC_LOCK capability); running unlocked",
                        self.size, os.strerror(err))
            return False
        self.mlocked = True
        return True

    def populate(self, offset: int, length: int, lock: bool = False) -> None:
        """Fault in (and with `lock`, mlock) one range: an extent arriving from another
        tenant's file. Best effort: a failure leaves the pages to fault on first write."""
        assert self._map is not None
        try:
            if lock:
                self._range_call("mlock", offset, length)
            else:
                self._map.madvise(MADV_POPULATE_WRITE, offset, length)
        except OSError as exc:
            log.debug("populating [%d, +%d) failed: %s", offset, length, exc)

    def release(self, offset: int, length: int, locked: bool = False) -> None:
        """Give one range's pages back to the kernel (an extent leaving for another tenant's
        file): what this file held there is gone, its mappings read zeros."""
        assert self._map is not None
        if locked:
            self._range_call("munlock", offset, length)
        try:
            self._map.madvise(mmap.MADV_REMOVE, offset, length)
        except OSError as exc:
            log.warning("could not release [%d, +%d) of pool %s: %s", offset, length,
                        self.pool_id, exc)

    @property
    def closed(self) -> bool:
        return self._map is None

    def resident_bytes(self) -> int:
        """Bytes of the file that have pages (what it costs in memory now)."""
        return os.fstat(self.fd).st_blocks * 512

    def _range_call(self, name: str, offset: int, length: int) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        assert self._map is not None
        base = ctypes.c_void_p.from_buffer(self._map)
        try:
            address = ctypes.addressof(base) + offset
            if getattr(libc, name)(ctypes.c_void_p(address), ctypes.c_size_t(length)) != 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        finally:
            del base

    def view(self) -> memoryview:
        """The daemon's own mapping (tests and diagnostics; the daemon never copies KV)."""
        assert self._map is not None
        return memoryview(self._map)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                log.debug("pool mapping still exported; left to the GC")
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.path and not self.persist:
            Path(self.path).unlink(missing_ok=True)
            Path(self.path + ".id").unlink(missing_ok=True)


def _file_pool_id(path: str, persist: bool) -> str:
    """A persisted pool keeps its id across restarts (a sidecar file), so clients know."""
    sidecar = Path(path + ".id")
    if persist and sidecar.exists():
        text = sidecar.read_text().strip()
        if text:
            return text
    pool_id = secrets.token_hex(8)
    if persist:
        sidecar.write_text(pool_id + "\n")
    return pool_id
