"""What a warm-restart directory holds, and the record that says what it is.

Layout of `restart.directory` (state layout version STATE_VERSION, docs/operations.md):

  state.json           the record: layout versions, pool and extent size, the tenants' pool
                       files (and their pool ids), every namespace (identity and layout)
  pool, pool.<hash>    the default tenant's pool file, and each other tenant's
  index-<namespace>    a namespace's shared index (kvd_proto/index_layout.py, version 1):
                       keys, slot states, generations, the reset and reclaim epochs
  ranks-<namespace>    its LRU ranks (int64 per slot), so the eviction order carries on, then its
                       retained blocks' words (int64 per slot: kvd_server/manager/retention.py)
  lock                 flock-ed by the daemon using the directory (one at a time), its pid
  sessions/<id>        one small JSON file per registered engine session: its namespace and
                       its process (pid and start time), removed when the session ends

The record changes only when a namespace or a tenant's file comes or goes, and is replaced
atomically (written beside, then renamed), so a daemon killed at any instant leaves either the
old record or the new one. What changes per block lives in the index files themselves, so
nothing is written per store. A session's file is written before the session can be granted
a slot, so an engine that may write into the pool is always on record.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import hashlib
import json
import logging
import mmap
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvd_proto.index_layout import VERSION as INDEX_VERSION
from kvd_proto.version import __version__
from kvd_proto.wire import KvLayout
from kvd_server.config import DEFAULT_TENANT
from kvd_server.memory.pool import HostPool
from kvd_server.memory.shm_index import ShmIndex

log = logging.getLogger(__name__)

STATE_VERSION = 1             # this directory's layout; a daemon adopts only its own version
STATE_FILE = "state.json"
LOCK_FILE = "lock"                # held (flock) by the daemon that uses the directory
SESSIONS = "sessions"
MAX_SESSION_RECORDS = 65536   # what a daemon reads back (more cannot be: max_sessions)


class StateError(Exception):
    """The directory cannot hold warm-restart state (the message says why)."""


# statfs(2)'s f_type of the filesystems whose files are memory: what restart.directory must be
# on (docs/operations.md, "Warm restart"), so that the pool's pages stay in RAM.
MEMORY_FILESYSTEMS = {0x01021994: "tmpfs", 0x958458F6: "hugetlbfs", 0x858458F6: "ramfs"}
# Names for the f_types a refusal is likeliest to meet (any other is named by its number,
# or by /proc/self/mountinfo when it says).
_DISK_FILESYSTEMS = {0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs",
                     0x794C7630: "overlayfs", 0x6969: "nfs", 0x2FC12FC1: "zfs",
                     0xF2F52010: "f2fs", 0x65735546: "fuse", 0x01021997: "9p"}


def filesystem_type(path: str) -> int | None:
    """statfs(2)'s f_type of the filesystem holding `path` (None where the call fails)."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)       # struct statfs: 120 bytes on 64-bit Linux
    if libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF     # f_type comes first


def _mount_type(path: str) -> str:
    """The filesystem type /proc/self/mountinfo gives the mount holding `path` ("" if none):
    its own name ("ext4", not the magic number ext2, ext3 and ext4 share)."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, rest = line.partition(" - ")
            parts = fields.split()
            if len(parts) < 5 or not rest:
                continue
            point = parts[4].replace("\\040", " ")
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, fstype = point, rest.split()[0]
    return fstype


def check_memory_filesystem(path: str) -> None:
    """Refuse (StateError) a warm-restart directory on a filesystem that is not memory: the
    pool's and the indexes' pages would be written back to the disk under it as engines
    store blocks (slow, wearing the drive), and its files would survive a reboot that made
    them meaningless. A filesystem statfs cannot name is let through (logged)."""
    kind = filesystem_type(path)
    if kind is None:
        log.warning("warm restart: cannot tell the filesystem of %s (statfs failed): it must "
                    "be memory (tmpfs or hugetlbfs)", path)
        return
    if kind in MEMORY_FILESYSTEMS:
        return
    name = _mount_type(path) or _DISK_FILESYSTEMS.get(kind, f"a filesystem of type {kind:#x}")
    raise StateError(f"{path} is on {name}, not on memory (tmpfs or hugetlbfs): the pool's "
                     "pages there would be written to the disk as engines store blocks "
                     "(slow, and kept across a reboot that makes them stale); use a tmpfs "
                     "directory such as /dev/shm/kvd or /run/kvd/state (or restart.store = "
                     '"systemd" under systemd)')


@dataclass(slots=True, frozen=True)
class NamespaceRecord:
    """A namespace's identity: everything namespace_id digests, to recreate it as it was."""

    id: str
    model: str
    salt: str
    tenant: str
    block_bytes: int
    num_ranks: int
    shard_bytes: int
    tokens_per_block: int
    dtype: str
    max_key_bytes: int
    # Agent sessions' tags, by the ids the retained blocks' words name (id 1 first): see
    # kvd_server/manager/retention.py. Empty in a record of a kvd before them.
    tags: tuple[str, ...] = ()

    @property
    def layout(self) -> KvLayout:
        return KvLayout(self.block_bytes, self.num_ranks, self.shard_bytes,
                        self.tokens_per_block, self.dtype, self.max_key_bytes)

    @classmethod
    def of(cls, ns_id: str, model: str, layout: KvLayout, salt: str,
           tenant: str) -> NamespaceRecord:
        return cls(ns_id, model, salt, tenant, layout.block_bytes, layout.num_ranks,
                   layout.shard_bytes, layout.tokens_per_block, layout.dtype,
                   layout.max_key_bytes)


@dataclass(slots=True)
class Manifest:
    """The record of a warm-restart directory (see the module doc)."""

    pool_size: int
    extent_bytes: int
    state_version: int = STATE_VERSION
    index_version: int = INDEX_VERSION
    kvd_version: str = __version__
    tenants: dict[str, str] = field(default_factory=dict)    # tenant -> its pool file's id
    namespaces: dict[str, NamespaceRecord] = field(default_factory=dict)
    written_at: float = 0.0                                  # unix time

    def to_json(self) -> str:
        doc = dataclasses.asdict(self)
        return json.dumps(doc, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        namespaces = {}
        for k, v in dict(doc.pop("namespaces")).items():
            v = dict(v)
            v["tags"] = tuple(str(t) for t in v.get("tags", ()))
            namespaces[k] = NamespaceRecord(**v)
        tenants = {str(k): str(v) for k, v in dict(doc.pop("tenants")).items()}
        return cls(namespaces=namespaces, tenants=tenants, **doc)

    def unservable(self, pool_size: int, extent_bytes: int) -> str | None:
        """Why this daemon cannot adopt what the record describes (None: it can)."""
        if self.state_version != STATE_VERSION:
            return (f"its state layout is version {self.state_version}, this kvd "
                    f"{__version__} reads version {STATE_VERSION}")
        if self.index_version != INDEX_VERSION:
            return (f"its indexes are layout version {self.index_version}, this kvd reads "
                    f"version {INDEX_VERSION}")
        if self.pool_size != pool_size:
            return f"pool.size changed ({self.pool_size} -> {pool_size} bytes)"
        if self.extent_bytes != extent_bytes:
            return f"pool.extent_size changed ({self.extent_bytes} -> {extent_bytes} bytes)"
        return None


@dataclass(slots=True, frozen=True)
class SessionRecord:
    """An engine session of a daemon: whose process may still copy into or out of the pool."""

    session: str
    namespace: str
    pid: int
    start: int            # the process's start time (clock ticks after boot): its identity
    uid: int


def pool_file_name(tenant: str) -> str:
    if tenant == DEFAULT_TENANT:
        return "pool"
    return "pool." + hashlib.sha256(tenant.encode()).hexdigest()[:16]


class Keeper(Protocol):
    """Where a warm restart keeps the memory files and the records: a directory
    (`StateDir`) or systemd's file-descriptor store (kvd_server/restart/fdstore.py)."""

    where: str                      # for the log and `kvd stats`

    def prepare(self) -> None: ...

    def read(self) -> Manifest | None: ...

    def write(self, manifest: Manifest) -> None: ...

    def pool(self, tenant: str, size: int, adopt_id: str) -> HostPool: ...

    def index(self, ns_id: str, geometry: tuple[int, int, int, int, int], *,
              adopt: bool) -> ShmIndex: ...

    def drop_index(self, ns_id: str, index: ShmIndex | None) -> None: ...

    def policy_memory(self, ns_id: str, nbytes: int, *, adopt: bool) -> mmap.mmap: ...

    def record_session(self, record: SessionRecord) -> None: ...

    def forget_session(self, session_id: str) -> None: ...

    def old_sessions(self) -> list[SessionRecord]: ...

    def clear_sessions(self) -> None: ...

    def clear(self) -> int: ...


class StateDir:
    """The warm-restart directory of one daemon (see the module doc)."""

    def __init__(self, path: str, *, memory_only: bool = False) -> None:
        """`memory_only`: refuse a directory whose filesystem is not memory (the daemon's;
        tools and tests lay a directory out anywhere)."""
        self.path = Path(path)
        self.sessions = self.path / SESSIONS
        self.where = str(self.path)
        self.memory_only = memory_only

    def prepare(self) -> None:
        """Create the directory (0700) if missing; refuse one another uid owns, that this
        daemon cannot write, or (`memory_only`) that is not on memory (StateError naming
        it)."""
        for d in (self.path, self.sessions):
            try:
                d.mkdir(mode=0o700, parents=d is self.path, exist_ok=True)
                st = os.stat(d, follow_symlinks=False)
            except OSError as exc:
                raise StateError(f"cannot use {d} as the warm-restart directory: "
                                 f"{exc.strerror}") from None
            if not stat.S_ISDIR(st.st_mode):
                raise StateError(f"{d} is not a directory")
            if st.st_uid != os.geteuid():
                raise StateError(f"{d} belongs to uid {st.st_uid}, not to the daemon's uid "
                                 f"{os.geteuid()}: the pool's bytes would be another user's "
                                 "to read and change")
            if not os.access(d, os.W_OK | os.X_OK):
                raise StateError(f"{d} is not writable by uid {os.geteuid()}")
        if self.memory_only:
            check_memory_filesystem(str(self.path))
        # One daemon per directory, for as long as it runs: two would adopt, clear and write
        # the same pool files under each other.
        self._lock = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self._lock, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._lock)
            raise StateError(f"{self.path} is in use by another kvd daemon (pid {holder}); "
                             "give each daemon its own restart.directory") from None
        os.ftruncate(self._lock, 0)
        os.pwrite(self._lock, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Let go of the directory's lock (another process may use it from now on)."""
        lock, self._lock = getattr(self, "_lock", -1), -1
        if lock >= 0:
            os.close(lock)

    # ------------------------------------------------------------------ paths
    def pool_path(self, tenant: str) -> Path:
        return self.path / pool_file_name(tenant)

    def index_path(self, ns_id: str) -> Path:
        return self.path / f"index-{ns_id}"

    # ------------------------------------------------------------------ memory files
    def pool(self, tenant: str, size: int, adopt_id: str) -> HostPool:
        """The tenant's pool file (adopted as it is with `adopt_id`, else a fresh one)."""
        return HostPool.warm(str(self.pool_path(tenant)), size, adopt_id)

    def index(self, ns_id: str, geometry: tuple[int, int, int, int, int], *,
              adopt: bool) -> ShmIndex:
        """A namespace's index file: the previous daemon's (`adopt`) or a new one."""
        path = self.index_path(ns_id)
        if not adopt:
            path.unlink(missing_ok=True)        # a leftover of a namespace never recorded
        return ShmIndex(*geometry, name=f"kvd-index-{ns_id[:12]}", path=str(path),
                        adopt=adopt)

    def drop_index(self, ns_id: str, index: ShmIndex | None) -> None:
        self.index_path(ns_id).unlink(missing_ok=True)
        (self.path / f"ranks-{ns_id}").unlink(missing_ok=True)

    def policy_memory(self, ns_id: str, nbytes: int, *, adopt: bool) -> mmap.mmap:
        """The file `ranks-<namespace>` mapped: the previous daemon's (`adopt`, when it has
        the right size), else a new one of zeros."""
        path = self.path / f"ranks-{ns_id}"
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = -1
        if adopt:
            try:
                fd = os.open(path, flags)
                if os.fstat(fd).st_size != nbytes:
                    os.close(fd)
                    fd = -1
            except OSError:
                fd = -1
        if fd < 0:
            path.unlink(missing_ok=True)
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, nbytes)
        try:
            return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ the record
    def read(self) -> Manifest | None:
        """The record a previous daemon left (None: none). ValueError when it is unreadable
        (the caller starts cold and says why)."""
        try:
            fd = os.open(self.path / STATE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ValueError(f"cannot open it: {exc.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            text = f.read(64 << 20)
        try:
            return Manifest.from_json(text.decode())
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            raise ValueError(f"{STATE_FILE} is not a kvd state record ({exc})") from None

    def write(self, manifest: Manifest) -> None:
        """Replace the record atomically."""
        manifest.written_at = time.time()
        self._replace(self.path / STATE_FILE, manifest.to_json().encode())

    @staticmethod
    def _replace(path: Path, data: bytes) -> None:
        tmp = path.with_name(path.name + ".new")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    # ------------------------------------------------------------------ sessions
    def record_session(self, record: SessionRecord) -> None:
        """On record before the session can be granted a slot (see the module doc)."""
        self._replace(self.sessions / record.session,
                      json.dumps(dataclasses.asdict(record)).encode())

    def forget_session(self, session_id: str) -> None:
        with contextlib.suppress(OSError):
            (self.sessions / session_id).unlink()

    def old_sessions(self) -> list[SessionRecord]:
        """The sessions a previous daemon had on record (unreadable records are skipped:
        they were being written when it died, before the session could hold anything)."""
        out: list[SessionRecord] = []
        try:
            names = sorted(os.listdir(self.sessions))[:MAX_SESSION_RECORDS]
        except OSError:
            return out
        for name in names:
            if name.endswith(".new"):
                continue
            try:
                fd = os.open(self.sessions / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                with os.fdopen(fd, "rb") as f:
                    doc: Any = json.loads(f.read(4096))
                out.append(SessionRecord(**doc))
            except (OSError, ValueError, TypeError):
                log.warning("skipped an unreadable session record %s of the previous daemon",
                            name)
        return out

    def clear_sessions(self) -> None:
        """The previous daemon's sessions were taken over: this daemon records its own."""
        with contextlib.suppress(OSError):
            for name in os.listdir(self.sessions):
                with contextlib.suppress(OSError):
                    (self.sessions / name).unlink()

    # ------------------------------------------------------------------ a cold start
    def clear(self) -> int:
        """Remove what a previous daemon left (its record first: a daemon killed while this
        runs starts cold again); how many files. An engine still mapping an old pool file
        keeps that memory until it unmaps it: nothing new is ever stored under it."""
        removed = 0
        names = [STATE_FILE] + sorted(n for n in os.listdir(self.path) if n != STATE_FILE)
        for name in names:
            if name == SESSIONS:
                continue
            if name == STATE_FILE or name.startswith(("pool", "index-", "ranks-")) \
                    or name.endswith(".new"):
                with contextlib.suppress(FileNotFoundError):
                    (self.path / name).unlink()
                    removed += 1
        self.clear_sessions()
        return removed
