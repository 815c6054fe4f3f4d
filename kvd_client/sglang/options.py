"""What SGLang's `--hicache-storage-backend-extra-config` tells kvd's backend, checked.

SGLang hands a dynamic backend the whole extra-config dict (its own keys included:
`backend_name`, `module_path`, `class_name`, `interface_v1`, ...); kvd reads only its `kvd_*`
keys and leaves the rest to SGLang. A key of the wrong type or range is refused at start with
a message naming it (the engine does not start on a configuration kvd would misread), never
guessed. No SGLang or torch import here, so the checks are tested on their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvd_client.dataplane.cpu import MAX_COPY_THREADS, default_copy_threads
from kvd_proto.paths import default_socket_path

DEFAULT_DEADLINE_MS = 500
MAX_DEADLINE_MS = 60_000
MAX_MODEL_CHARS = 512
MAX_RESERVE = 4096            # MAX_GRANTED_SLOTS: more is never granted at once
KNOWN_KEYS = frozenset({"kvd_socket", "kvd_deadline_ms", "kvd_reserve", "kvd_model",
                        "kvd_namespace", "kvd_keep_evicted", "kvd_copy_threads"})


class OptionError(ValueError):
    """An extra-config key kvd cannot use: the message names it and what it accepts."""


@dataclass(frozen=True, slots=True)
class BackendOptions:
    socket_path: str
    deadline_s: float
    reserve: int              # 0: sized from the store rate (kvd_client/offload/reserve.py)
    model: str                # "" : SGLang's model name
    namespace: str            # extra scope for the namespace ("" : none)
    keep_evicted: bool
    copy_threads: int         # threads a large batch's copy is shared among (>= 1)


def _int(extra: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise OptionError(f"{key} must be an integer {lo}..{hi}, not {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise OptionError(f"{key} must be an integer {lo}..{hi}, not {value!r}") from None
    if not lo <= number <= hi:
        raise OptionError(f"{key} must be an integer {lo}..{hi}, not {number}")
    return number


def _str(extra: Mapping[str, Any], key: str) -> str:
    value = extra.get(key, "")
    if not isinstance(value, str) or len(value) > MAX_MODEL_CHARS or "\x00" in value:
        raise OptionError(f"{key} must be a string of at most {MAX_MODEL_CHARS} characters")
    return value


def _flag(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise OptionError(f"{key} must be true or false, not {value!r}")


def parse(extra: Mapping[str, Any] | None) -> BackendOptions:
    """The backend's options from SGLang's extra config (None: every default)."""
    extra = extra or {}
    if not isinstance(extra, Mapping):
        raise OptionError("the extra config must be a JSON object")
    unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith("kvd_")
                     and k not in KNOWN_KEYS)
    if unknown:
        raise OptionError(f"unknown kvd option(s) {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(KNOWN_KEYS))}")
    socket = _str(extra, "kvd_socket") or default_socket_path()
    return BackendOptions(
        socket_path=socket,
        deadline_s=_int(extra, "kvd_deadline_ms", DEFAULT_DEADLINE_MS, 1, MAX_DEADLINE_MS) / 1000,
        reserve=_int(extra, "kvd_reserve", 0, 0, MAX_RESERVE),
        model=_str(extra, "kvd_model"),
        namespace=_str(extra, "kvd_namespace"),
        keep_evicted=_flag(extra, "kvd_keep_evicted", True),
        copy_threads=_int(extra, "kvd_copy_threads", 0, 0, MAX_COPY_THREADS)
        or default_copy_threads())
