"""Warm restart through systemd's file-descriptor store (`restart.store = "systemd"`).

Under systemd with `FileDescriptorStoreMax=` set, the daemon hands every memory file it must
keep to systemd (`FDSTORE=1` with a name, kvd_server/ops/notify.py), which holds them open while the
daemon restarts (crash, upgrade, `systemctl restart`) and passes them back to the next one
(`LISTEN_FDS`, `LISTEN_FDNAMES`). Nothing is named in a filesystem, so the pools stay sealed
memfds, handed to engines of any allowed uid as without warm restart.

Names in the store:

  kvd-pool-<tenant hash>   a tenant's pool (sealed memfd: no shrink, no grow)
  kvd-index-<namespace>    a namespace's index (sealed against size changes; engines get a
                           read-only descriptor of it, which cannot write it)
  kvd-ranks-<namespace>    its LRU ranks, so the eviction order carries on
  kvd-state-<n>            the record (JSON, state layout STATE_VERSION), the highest n wins
  kvd-sessions-<n>         the engine sessions on record (JSON list), the highest n wins

A record is replaced by storing the new one under the next n, then removing the old: a
daemon killed between the two leaves both, and the next one reads the newer.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import mmap
import os
import re
from typing import Any

from kvd_server.memory.pool import HostPool, PoolError
from kvd_server.memory.shm_index import ShmIndex
from kvd_server.ops import notify
from kvd_server.restart.state import (
    MAX_SESSION_RECORDS,
    Manifest,
    SessionRecord,
    StateError,
    pool_file_name,
)

log = logging.getLogger(__name__)

PREFIX = "kvd-"
_NUMBERED = re.compile(r"^kvd-(state|sessions)-(\d+)$")
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


class FdStore:
    """The warm-restart files in systemd's descriptor store (see the module doc)."""

    def __init__(self) -> None:
        self.where = "systemd's file-descriptor store"
        self._passed: dict[str, list[int]] = {}      # what systemd handed back, by name
        self._serial = {"state": 0, "sessions": 0}
        self._sessions: dict[str, SessionRecord] = {}

    def prepare(self) -> None:
        if not os.environ.get("NOTIFY_SOCKET"):
            raise StateError('restart.store = "systemd" needs the daemon to run as a systemd '
                             "service (NOTIFY_SOCKET is not set) whose unit sets "
                             'FileDescriptorStoreMax=; elsewhere use restart.store = '
                             '"directory"')
        self._passed = {name: fds for name, fds in notify.listen_fds().items()}
        for name, fds in list(self._passed.items()):
            if not name.startswith(PREFIX):
                for fd in fds:
                    os.close(fd)
                del self._passed[name]
        for name in self._passed:
            m = _NUMBERED.match(name)
            if m:
                kind, n = m.group(1), int(m.group(2))
                self._serial[kind] = max(self._serial[kind], n)

    def _take(self, name: str) -> int | None:
        """The descriptor systemd passed back under `name` (once), or None."""
        fds = self._passed.pop(name, None)
        if not fds:
            return None
        for extra in fds[1:]:                      # stored twice: the first is the one
            os.close(extra)
        return fds[0]

    # ------------------------------------------------------------------ the records
    def _latest(self, kind: str) -> bytes | None:
        numbered = sorted(((int(m.group(2)), name) for name in self._passed
                           if (m := _NUMBERED.match(name)) and m.group(1) == kind),
                          reverse=True)
        for _, name in numbered:
            fd = self._passed[name][0]
            try:
                return os.pread(fd, 64 << 20, 0)
            except OSError:
                continue
        return None

    def _replace(self, kind: str, data: bytes) -> None:
        """Store `data` as the next record of `kind`, then drop the older ones."""
        self._serial[kind] += 1
        name = f"kvd-{kind}-{self._serial[kind]}"
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.write(fd, data)
            if not notify.store_fds(name, [fd]):
                raise OSError("systemd did not take it")
        finally:
            os.close(fd)
        for old in range(self._serial[kind] - 1, 0, -1):
            stale = f"kvd-{kind}-{old}"
            notify.remove_fds(stale)
            for fd in self._passed.pop(stale, []):
                os.close(fd)
            if old < self._serial[kind] - 8:
                break

    def read(self) -> Manifest | None:
        data = self._latest("state")
        if data is None:
            return None
        try:
            return Manifest.from_json(data.decode())
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            raise ValueError(f"the stored record is not a kvd state record ({exc})") from None

    def write(self, manifest: Manifest) -> None:
        import time

        manifest.written_at = time.time()
        self._replace("state", manifest.to_json().encode())

    # ------------------------------------------------------------------ memory files
    def pool(self, tenant: str, size: int, adopt_id: str) -> HostPool:
        name = "kvd-" + pool_file_name(tenant)
        fd = self._take(name) if adopt_id else None
        if fd is not None:
            return HostPool.adopt(fd, size, "memfd", adopt_id)
        pool = HostPool.create(size, "memfd", name=name)
        notify.remove_fds(name)
        if not notify.store_fds(name, [pool.fd]):
            pool.close()
            raise PoolError("systemd did not take the pool into its descriptor store")
        return pool

    def index(self, ns_id: str, geometry: tuple[int, int, int, int, int], *,
              adopt: bool) -> ShmIndex:
        name = f"kvd-index-{ns_id}"
        if adopt:
            fd = self._take(name)
            if fd is None:
                raise ValueError(f"systemd kept no {name}")
            try:
                return ShmIndex(*geometry, name=name, path=f"/proc/self/fd/{fd}", adopt=True)
            finally:
                os.close(fd)                  # the index holds its own descriptors
        probe = ShmIndex(*geometry, private=True)    # only for its size
        size = probe.header.file_bytes
        probe.close()
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)
            index = ShmIndex(*geometry, name=name, path=f"/proc/self/fd/{fd}", create=False)
            notify.remove_fds(name)
            if not notify.store_fds(name, [fd]):
                index.close()
                raise OSError(f"systemd did not take {name} into its descriptor store")
            return index
        finally:
            os.close(fd)

    def drop_index(self, ns_id: str, index: ShmIndex | None) -> None:
        for name in (f"kvd-index-{ns_id}", f"kvd-ranks-{ns_id}"):
            notify.remove_fds(name)
            for fd in self._passed.pop(name, []):
                os.close(fd)

    def policy_memory(self, ns_id: str, nbytes: int, *, adopt: bool) -> mmap.mmap:
        name = f"kvd-ranks-{ns_id}"
        fd = self._take(name) if adopt else None
        if fd is not None and os.fstat(fd).st_size != nbytes:
            os.close(fd)
            fd = None
        if fd is None:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
            notify.remove_fds(name)
            if not notify.store_fds(name, [fd]):
                os.close(fd)
                raise OSError(f"systemd did not take {name} into its descriptor store")
        try:
            return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ sessions
    def _write_sessions(self) -> None:
        doc = [dataclasses.asdict(r) for r in self._sessions.values()]
        self._replace("sessions", json.dumps(doc).encode())

    def record_session(self, record: SessionRecord) -> None:
        self._sessions[record.session] = record
        self._write_sessions()

    def forget_session(self, session_id: str) -> None:
        if self._sessions.pop(session_id, None) is not None:
            self._write_sessions()

    def old_sessions(self) -> list[SessionRecord]:
        data = self._latest("sessions")
        if data is None:
            return []
        try:
            doc: Any = json.loads(data)
            out = [SessionRecord(**d) for d in doc[:MAX_SESSION_RECORDS]]
        except (ValueError, TypeError):
            log.warning("the stored session records are unreadable: none taken over")
            return []
        self._sessions.update({r.session: r for r in out})    # on record until released
        return out

    def clear_sessions(self) -> None:
        self._sessions.clear()
        self._write_sessions()

    def clear(self) -> int:
        """Drop everything systemd handed back (a cold start)."""
        removed = 0
        for name, fds in list(self._passed.items()):
            notify.remove_fds(name)
            for fd in fds:
                os.close(fd)
            removed += 1
        self._passed.clear()
        return removed
