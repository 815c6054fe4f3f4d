"""Agent sessions' retention hints as engines carry them per request (docs/agents.md).

An engine passes a request's hint in its own per-request parameters; vLLM's are the request's
`kv_transfer_params`, whose `"kvd"` entry is read here:

    {"kvd": {"session": "s-123", "retain_s": 300}}

`session` (a string) tags the blocks the request loads and stores with its agent session, so
the session can be listed, prewarmed and released; `retain_s` (a number of seconds) keeps them
in the pool that long (absent with a session: the daemon's retention.default_s; 0: no
retention). Anything else there is malformed: refused for that request (counted, one log line
per interval), which then goes on exactly as without a hint.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

HINT_PARAM = "kvd"                      # the entry of an engine's per-request parameters
MAX_RETAIN_MS = (1 << 32) - 1           # the wire's u32 milliseconds
MAX_TAG_BYTES = 1024                    # the daemon applies its own retention.max_tag_bytes
FIELDS = ("session", "retain_s")


class HintError(ValueError):
    """A malformed hint (the message says what is wrong)."""


class Hint(NamedTuple):
    session: str
    retain_ms: int          # 0: the daemon's retention.default_s


def parse_hint(params: object) -> Hint | None:
    """The hint in an engine's per-request parameters (a dict or None): None when there is
    none (or it asks for no retention); HintError when it is malformed."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise HintError(f"per-request parameters are a {type(params).__name__}, not a dict")
    raw: Any = params.get(HINT_PARAM)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise HintError(f'"{HINT_PARAM}" is a {type(raw).__name__}, not an object')
    unknown = sorted(str(k)[:32] for k in raw if k not in FIELDS)
    if unknown:
        raise HintError(f'unknown field(s) {", ".join(unknown)} (known: {", ".join(FIELDS)})')
    session = raw.get("session", "")
    if not isinstance(session, str):
        raise HintError(f"session is a {type(session).__name__}, not a string")
    if len(session.encode("utf-8", "surrogatepass")) > MAX_TAG_BYTES:
        raise HintError(f"session is longer than {MAX_TAG_BYTES} bytes")
    if not session.isprintable():
        raise HintError("session has control characters")
    try:
        session.encode()
    except UnicodeEncodeError:
        raise HintError("session is not valid UTF-8 text") from None
    retain = raw.get("retain_s")
    if retain is None:
        if not session:
            return None
        return Hint(session, 0)
    if isinstance(retain, bool) or not isinstance(retain, int | float):
        raise HintError(f"retain_s is a {type(retain).__name__}, not a number")
    if not math.isfinite(retain) or retain < 0:
        raise HintError(f"retain_s {retain!r} is not a number of seconds >= 0")
    ms = math.ceil(retain * 1000)
    if ms > MAX_RETAIN_MS:
        raise HintError(f"retain_s {retain!r} is too long (at most {MAX_RETAIN_MS // 1000})")
    if ms == 0:
        return None
    return Hint(session, ms)
