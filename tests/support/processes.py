"""Child processes a test drives line by line: read one line of a child's stdout within a bound
(failing with what the child wrote to stderr), and kill and reap a child so that none is ever
left behind. Shared by the fault tests' workers and victims and by the engine processes of
tests/support/offload_engine.py."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
from typing import IO, Any


def readline_within(proc: subprocess.Popen[str], timeout: float,
                    stderr: IO[Any] | None = None) -> str:
    """One line of the child's stdout, or fail after `timeout` seconds with the tail of its
    stderr: `stderr`, the file it writes it to, if given; else its stderr pipe, if it has one
    (read once the child is killed and reaped, so the read cannot block)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        what = "said nothing" if not ready else "exited"
        raise AssertionError(f"child process {proc.pid} {what} within {timeout}s: "
                             f"{_stderr_tail(proc, stderr)}")
    return line


def _stderr_tail(proc: subprocess.Popen[str], stderr: IO[Any] | None) -> str:
    if stderr is not None:
        with contextlib.suppress(OSError, ValueError):
            stderr.seek(0)
            data = stderr.read()
            return (data.decode(errors="replace") if isinstance(data, bytes) else data)[-3000:]
        return ""
    if proc.stderr is not None:
        reap(proc, close=False)
        return proc.stderr.read()[-3000:]
    return ""


def reap(proc: subprocess.Popen[str], close: bool = True) -> None:
    """Kill (a stopped process dies on SIGKILL too) and wait; never leaves a child behind.
    `close`: close its pipes too."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
    proc.wait(10)
    if close:
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
