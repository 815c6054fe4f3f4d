"""Admin tokens: the permission to reset and drain, separate from access to the socket.

gRPC on a Unix socket carries no peer credentials, so the daemon cannot tell an operator from
an engine by the call alone. An operator proves who they are on the attach socket instead
(`"role": "admin"`, checked with SO_PEERCRED against root, the daemon's uid and
`server.admin_uids` / `server.admin_gids`) and gets a short-lived admin token; Reset and Drain
require it as `kvd-admin-token` metadata. A static token read from `server.admin_token_file`
is accepted too: it is the only way in over the TLS TCP listener, where there is no peer to ask.
The client side (asking for a token) is `kvd_proto.attach.request_admin_token`.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
import time
from collections import OrderedDict
from collections.abc import Callable

ADMIN_TOKEN_TTL_S = 300.0
MAX_ADMIN_TOKENS = 64        # live issued tokens; issuing one more forgets the oldest
MIN_STATIC_TOKEN_CHARS = 16
MAX_STATIC_TOKEN_CHARS = 4096


class TokenFileError(ValueError):
    """The admin token file is missing, unreadable, too short or open to everyone."""


def read_token_file(path: str) -> str:
    """The static admin token: the file's first line, stripped.

    Refused when others may write the file or when the token is shorter than 16 characters:
    either would hand reset and drain to anyone on the node.
    """
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as fh:
            text = fh.read(MAX_STATIC_TOKEN_CHARS + 2)
    except FileNotFoundError:
        raise TokenFileError(f"admin token file {path} does not exist") from None
    except PermissionError:
        raise TokenFileError(f"admin token file {path} is not readable") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenFileError(f"cannot read admin token file {path}: {exc}") from None
    if st.st_mode & stat.S_IWOTH:
        raise TokenFileError(f"admin token file {path} is writable by everyone; "
                             "chmod o-w (0600 or 0640 recommended)")
    token = text.splitlines()[0].strip() if text.strip() else ""
    if not MIN_STATIC_TOKEN_CHARS <= len(token) <= MAX_STATIC_TOKEN_CHARS:
        raise TokenFileError(f"admin token in {path} must be {MIN_STATIC_TOKEN_CHARS}.."
                             f"{MAX_STATIC_TOKEN_CHARS} characters (e.g. "
                             "`openssl rand -hex 32`)")
    return token


class AdminTokens:
    """Issued tokens (bounded, expiring) plus the optional static one."""

    def __init__(self, static: str = "", clock: Callable[[], float] = time.monotonic,
                 ttl: float = ADMIN_TOKEN_TTL_S) -> None:
        self._static = static
        self._clock = clock
        self.ttl = ttl
        self._issued: OrderedDict[str, float] = OrderedDict()  # token -> expiry

    def issue(self) -> str:
        now = self._clock()
        self._expire(now)
        while len(self._issued) >= MAX_ADMIN_TOKENS:
            self._issued.popitem(last=False)
        token = secrets.token_hex(32)
        self._issued[token] = now + self.ttl
        return token

    def valid(self, token: str) -> bool:
        if not token:
            return False
        if self._static and hmac.compare_digest(token.encode(), self._static.encode()):
            return True
        expiry = self._issued.get(token)
        if expiry is None:
            return False
        if expiry <= self._clock():
            del self._issued[token]
            return False
        return True

    def _expire(self, now: float) -> None:
        for token in [t for t, expiry in self._issued.items() if expiry <= now]:
            del self._issued[token]

    def __len__(self) -> int:
        return len(self._issued)
