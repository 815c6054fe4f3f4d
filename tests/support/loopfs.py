"""Real filesystems that misbehave for real, for fault tests: a loop-mounted ext4 image or a
tmpfs of a given size, made under a test's temporary directory and always unmounted (and the
loop device detached) afterwards. On them a test fills the disk (`fill`), shuts the
filesystem down so every read and write fails with EIO (`shutdown`, what xfstests' godown
does) or has ext4 meet an error so that `errors=remount-ro` makes it read-only
(`trigger_error`). No mocks: the daemon under test sees the kernel's own errors.

Needs root and a kernel that lets this process mount (`unavailable()` says why not; the
tests skip with that reason).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

EXT4_IOC_SHUTDOWN = 0x8004587D          # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2         # shut down now: no sync, no journal flush
UMOUNT_TIMEOUT = 20.0                   # a daemon may still be closing its files
TOOLS = ("mount", "umount", "losetup", "mkfs.ext4", "findmnt")


def _run(*argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def _check(*argv: str, timeout: float = 30.0) -> str:
    out = _run(*argv, timeout=timeout)
    if out.returncode != 0:
        said = (out.stderr or out.stdout).strip().splitlines()
        raise OSError(f"{' '.join(argv)} exited {out.returncode}: "
                      f"{said[0] if said else '(nothing said)'}")
    return out.stdout.strip()


@dataclass
class MountedFs:
    """A filesystem mounted at `path` (ext4 on the loop device `device`, or tmpfs)."""

    path: Path
    fstype: str
    device: str = ""                    # /dev/loopN (ext4)
    image: Path | None = None
    _fillers: list[Path] = field(default_factory=list)

    # ------------------------------------------------------------- what it says
    def options(self) -> str:
        """Its mount options as the kernel shows them (`findmnt`)."""
        return _check("findmnt", "-no", "OPTIONS", "--mountpoint", str(self.path))

    def free_bytes(self) -> int:
        """Bytes root may still allocate (reserved blocks included)."""
        st = os.statvfs(self.path)
        return st.f_bfree * st.f_frsize

    # ------------------------------------------------------------------ faults
    def fill(self, name: str = "filler") -> int:
        """Write zeros into a new file until the filesystem says ENOSPC, down to the last
        byte it takes; the bytes written. (`unfill` removes it.)"""
        path = self.path / name
        self._fillers.append(path)
        written = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            for chunk in (1 << 20, 64 << 10, 4096, 512, 1):
                zeros = bytes(chunk)
                while True:
                    try:
                        n = os.write(fd, zeros)
                    except OSError as exc:
                        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                            raise
                        break
                    written += n
                    if n < chunk:
                        break
            with contextlib.suppress(OSError):   # delayed allocation: on disk now
                os.fsync(fd)
        finally:
            os.close(fd)
        return written

    def unfill(self) -> None:
        """Remove what `fill` wrote (the space is free again)."""
        while self._fillers:
            with contextlib.suppress(FileNotFoundError):
                self._fillers.pop().unlink()

    def shutdown(self) -> None:
        """ext4: shut the filesystem down (EXT4_IOC_SHUTDOWN, NOLOGFLUSH): from now on every
        read, write, open and fsync on it fails with EIO; it still unmounts."""
        assert self.fstype == "ext4", "only ext4 here has the shutdown ioctl"
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
        finally:
            os.close(fd)

    def error_trigger(self) -> Path:
        """ext4's sysfs file that makes the filesystem meet an error (what ext4 does then
        follows its `errors=` mount option)."""
        assert self.fstype == "ext4" and self.device
        return Path("/sys/fs/ext4") / os.path.basename(self.device) / "trigger_fs_error"

    def trigger_error(self, message: str = "kvd fault test") -> None:
        self.error_trigger().write_text(message + "\n")

    def remount(self, *options: str) -> subprocess.CompletedProcess[str]:
        """`mount -o remount,OPTIONS` (the kernel's answer: it may refuse)."""
        return _run("mount", "-o", ",".join(("remount", *options)), str(self.path))

    # --------------------------------------------------------------- teardown
    def unmount(self) -> None:
        """Unmount (waiting out a process still closing its files), detach the loop device
        and delete the image; raises if the filesystem could not be unmounted cleanly (it is
        then lazily unmounted, so nothing stays behind either way)."""
        problem = ""
        if os.path.ismount(self.path):
            deadline = time.monotonic() + UMOUNT_TIMEOUT
            while True:
                out = _run("umount", str(self.path))
                if out.returncode == 0 or not os.path.ismount(self.path):
                    break
                if time.monotonic() > deadline:
                    problem = f"umount {self.path}: {out.stderr.strip()}"
                    _run("umount", "-l", str(self.path))
                    break
                time.sleep(0.1)
        if self.device:
            out = _run("losetup", "-d", self.device)
            if out.returncode != 0 and str(self.image) in _loop_backing(self.device):
                problem = problem or f"losetup -d {self.device}: {out.stderr.strip()}"
        if self.image is not None:
            with contextlib.suppress(FileNotFoundError):
                self.image.unlink()
        if problem:
            raise OSError(problem)


def _loop_backing(device: str) -> str:
    return _run("losetup", "--noheadings", "-O", "BACK-FILE", device).stdout


def make_ext4(where: Path, size: int, *, mkfs_args: Sequence[str] = (),
              options: Sequence[str] = ()) -> MountedFs:
    """An ext4 filesystem of `size` bytes in an image under `where`, on its own loop
    device, mounted at where/mnt (with `options`)."""
    image, mnt = where / "fs.img", where / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(size)
    _check("mkfs.ext4", "-q", "-F", *mkfs_args, str(image), timeout=60)
    device = _check("losetup", "--find", "--show", str(image))
    fs = MountedFs(mnt, "ext4", device, image)
    try:
        _check("mount", "-t", "ext4", *(["-o", ",".join(options)] if options else []),
               device, str(mnt))
    except BaseException:
        fs.unmount()
        raise
    return fs


def make_tmpfs(where: Path, size: int) -> MountedFs:
    """A tmpfs of `size` bytes mounted at where/mnt."""
    mnt = where / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    _check("mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "kvd-test", str(mnt))
    return MountedFs(mnt, "tmpfs")


@contextlib.contextmanager
def mounted(where: Path, fstype: str, size: int, *, mkfs_args: Sequence[str] = (),
            options: Sequence[str] = ()) -> Iterator[MountedFs]:
    """A filesystem (`make_ext4` / `make_tmpfs`: `mkfs_args` and `options` are ext4's) for
    the `with` block; unmounted after."""
    where.mkdir(parents=True, exist_ok=True)
    if fstype == "ext4":
        fs = make_ext4(where, size, mkfs_args=mkfs_args, options=options)
    elif fstype == "tmpfs":
        fs = make_tmpfs(where, size)
    else:
        raise ValueError(f"no {fstype} here (ext4 or tmpfs)")
    try:
        yield fs
    finally:
        fs.unmount()


@functools.cache
def unavailable(fstype: str = "ext4") -> str | None:
    """Why this process cannot make and mount such a filesystem here (None: it can).
    Probed for real once: a small filesystem is made, mounted and unmounted."""
    if os.geteuid() != 0:
        return f"mounting {fstype} needs root (this process has euid {os.geteuid()})"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed"
    probe = Path(tempfile.mkdtemp(prefix="kvd-loopfs-probe-"))
    try:
        with mounted(probe, fstype, 8 << 20) as fs:
            (fs.path / "probe").write_bytes(b"ok")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot mount {fstype} here: {exc}"
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None
