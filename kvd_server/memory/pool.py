"""The shared host pool: one memfd (default) or named file, mapped and pre-faulted once.

Engines map the same memory through the file descriptor they receive at attach, so the pool
needs no /dev/shm, hostIPC or shared names. Pre-faulting charges every page to the daemon's
cgroup up front and keeps page faults off the engines' copy path.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import secrets
import stat
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
        self.adopted = False        # a warm restart took it over with its bytes
        self._map: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED,
                                                mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def create(cls, size: int, backing: str = "memfd", directory: str = "",
               persist: bool = False, name: str = "kvd-pool") -> HostPool:
        """A pool file of `size` bytes (sparse until pre-faulted): an anonymous sealed memfd,
        or `directory/name` for a file-backed pool (a fresh file, unless `persist` adopts one
        no other process holds: `_open_pool_file`)."""
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
            fd, pool_id = _open_pool_file(path, persist)
            log.info("pool file %s: handed only to engines of uid %d%s (a file cannot be "
                     "sealed against an engine truncating it; memfd backing serves every uid)",
                     path, os.geteuid(), " and root" if os.geteuid() else "")
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

    @classmethod
    def warm(cls, path: str, size: int, adopt_id: str = "") -> HostPool:
        """A warm-restart pool file (kvd_server/restart/): with `adopt_id`, the existing file
        at `path` as the previous daemon left it (its bytes, the id its record gives it;
        PoolError when it is not that file); else a fresh file with a fresh id, replacing any
        file there (an engine still mapping the old one keeps its bytes until it unmaps it).
        Either way the file stays when the daemon exits."""
        size = (size + PAGE - 1) // PAGE * PAGE
        if adopt_id:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                raise PoolError(f"cannot open the pool file {path}: {exc.strerror}") from None
            return cls.adopt(fd, size, "file", adopt_id, path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        _check_room(os.path.dirname(path), size)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        except OSError as exc:
            raise PoolError(f"cannot create the pool file {path}: {exc.strerror}") from None
        try:
            os.ftruncate(fd, size)
            return cls(fd, size, "file", path, True, secrets.token_hex(8))
        except OSError as exc:
            os.close(fd)
            Path(path).unlink(missing_ok=True)
            raise PoolError(f"cannot create a pool of {size} bytes in {path}: "
                            f"{exc.strerror}") from None

    @classmethod
    def adopt(cls, fd: int, size: int, backing: str, pool_id: str,
              path: str | None = None) -> HostPool:
        """A previous daemon's pool in `fd` (owned from now on; closed on failure), checked:
        a regular file of the daemon's uid, the pool's size, and for a memfd its seals against
        size changes. PoolError says what does not match."""
        what = path or f"the kept {backing} pool"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise PoolError(f"{what} is not a regular file of uid {os.geteuid()}")
            if st.st_size != size:
                raise PoolError(f"{what} has {st.st_size} bytes, not the pool's {size}")
            if backing == "memfd":
                wanted = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & wanted != wanted:
                    raise PoolError(f"{what} is not sealed against size changes")
            pool = cls(fd, size, backing, path, True, pool_id)
        except (PoolError, OSError) as exc:
            os.close(fd)
            raise PoolError(str(exc)) from None
        pool.adopted = True
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
        remove = bool(self.path) and not self.persist and self._still_named(self.path)
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                log.debug("pool mapping still exported; left to the GC")
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if remove and self.path:
            Path(self.path).unlink(missing_ok=True)
            Path(self.path + ".id").unlink(missing_ok=True)

    def _still_named(self, path: str) -> bool:
        """Whether `path` is still this pool's file (not one a newer daemon put there)."""
        if self.fd < 0:
            return False
        try:
            here, there = os.fstat(self.fd), os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _check_room(directory: str, size: int) -> None:
    """Refuse a pool file its filesystem cannot hold: a tmpfs that runs out of room would kill
    the daemon or an engine with SIGBUS on a write, long after the start."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return
    room = st.f_bavail * st.f_frsize
    if room < size:
        from kvd_server.units import format_size

        raise PoolError(f"{directory} has {format_size(room)} free, a pool file of "
                        f"{format_size(size)} does not fit: enlarge that filesystem (a tmpfs: "
                        "mount -o remount,size=...) or choose a smaller pool.size")


def may_hold(backing: str, uid: int) -> bool:
    """Whether a peer of `uid` may be handed the pool's descriptor.

    Anyone for a sealed memfd. A file cannot be sealed and every writable descriptor of it can
    ftruncate it, which SIGBUSes (or zeroes) every other engine's copies: only root and the
    daemon's own uid, who can reach the daemon's memory anyway (ptrace, /proc/PID/fd).
    """
    return backing != "file" or uid in (0, os.geteuid())


def _open_pool_file(path: str, persist: bool) -> tuple[int, str]:
    """The descriptor and id of the pool file at `path`: never an inode that an engine of a
    previous daemon may still copy from.

    Such an engine looked up a HIT and copies the slot later; a new daemon storing into the
    same file would hand that copy another key's bytes. So an existing file is adopted only
    with `persist` and when no other process has it open or mapped; otherwise its name is
    unlinked (a mapping keeps the old inode's bytes until it goes) and a fresh file is created
    with a fresh id, so clients map the new memory instead of keeping the old.
    """
    sidecar = Path(path + ".id")
    if persist:
        fd = _adopt(path)
        if fd is not None:
            pool_id = _read_id(sidecar)
            if not pool_id:
                pool_id = secrets.token_hex(8)
                _write_id(sidecar, pool_id)
            log.info("pool file %s adopted (persist; no other process holds it), pool id %s",
                     path, pool_id)
            return fd, pool_id
    try:
        os.unlink(path)
        log.info("pool file %s was left by a previous daemon: replaced by a fresh file (an "
                 "engine still mapping the old one keeps its bytes until it unmaps it)", path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise PoolError(f"cannot replace the pool file {path} a previous daemon left: "
                        f"{exc.strerror}; remove it, or choose another pool.path") from None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:
        also = " (another daemon on the same pool.path?)" if exc.errno == errno.EEXIST else ""
        raise PoolError(f"cannot create the pool file {path}: {exc.strerror}{also}") from None
    pool_id = secrets.token_hex(8)
    if persist:
        _write_id(sidecar, pool_id)
    else:
        sidecar.unlink(missing_ok=True)
    return fd, pool_id


def _adopt(path: str) -> int | None:
    """A read/write descriptor of the existing pool file at `path` when no process but this
    one has it open or mapped (the kernel grants a write lease only then), else None."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, "not a regular file of the daemon's uid")
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    except OSError as exc:
        os.close(fd)
        why = "another process has it open or mapped" if exc.errno == errno.EAGAIN \
            else exc.strerror
        log.info("pool file %s not adopted (%s): a fresh one replaces it", path, why)
        return None
    return fd


def _read_id(sidecar: Path) -> str:
    """The persisted pool id ("" when absent or unreadable); never through a symlink."""
    try:
        fd = os.open(sidecar, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        text = f.read(64).decode("ascii", "replace").strip()
    return text if text.isalnum() else ""


def _write_id(sidecar: Path, pool_id: str) -> None:
    """Persist the pool id beside the file (a fresh file, never through a symlink)."""
    try:
        sidecar.unlink(missing_ok=True)
        fd = os.open(sidecar, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(pool_id + "\n")
    except OSError as exc:
        log.warning("could not keep the pool id in %s (%s): the next daemon gives the pool a "
                    "new id", sidecar, exc.strerror)
