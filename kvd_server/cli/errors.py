"""The `kvd` command's exit codes and its one-line failure, apart so that the commands and the
admin client raise the same error without importing each other (the codes are listed in
kvd_server/cli/main.py's docstring)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_UNREACHABLE = 2
EXIT_USAGE = 2          # a malformed command line (argparse's own code)


class CliError(Exception):
    """A failure the CLI reports in one line, with its exit code. `transient`: it may go away
    by itself (no socket yet, the daemon not answering yet), so `health --wait` tries again.
    `nobody`: nothing listens on the socket path (no socket, or a dead daemon's)."""

    def __init__(self, message: str, code: int = EXIT_ERROR, *, transient: bool = False,
                 nobody: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.transient = transient
        self.nobody = nobody
