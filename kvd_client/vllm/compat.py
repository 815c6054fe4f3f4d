"""Which vLLM this plug-in runs on, checked when vLLM loads it (before any other import).

kvd's manager and worker are written against vLLM 0.33's offloading interfaces
(`vllm.v1.kv_offload`: docs/vllm.md, "Supported versions"). A vLLM that lacks a name or a
method kvd uses fails here, at engine start, with a message that says what is missing and
which versions are supported, instead of a traceback inside the first scheduler step. A vLLM
outside the tested range that has every name runs, with a warning.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

log = logging.getLogger(__name__)

TESTED = "0.33"                     # the vLLM minor version kvd is tested against
SUPPORTED = "vLLM 0.33.x"
# What kvd_client.vllm imports from vLLM, by module.
NAMES = {
    "vllm.v1.kv_offload.base": (
        "CanonicalKVCaches", "GPULoadStoreSpec", "LoadStoreSpec", "LookupResult", "Medium",
        "OffloadingEvent", "OffloadingManager", "OffloadingSpec", "OffloadingWorker",
        "OffloadKey", "PrepareStoreOutput", "ReqContext", "RequestOffloadingContext",
        "ScheduleEndContext", "TransferResult"),
    "vllm.v1.kv_offload.config": ("OffloadingConfig",),
}
# The OffloadingManager methods vLLM's scheduler calls and kvd implements.
MANAGER_METHODS = ("lookup", "prepare_load", "touch", "complete_load", "prepare_store",
                   "complete_store", "on_new_request", "on_request_finished", "take_events",
                   "has_pending_work", "reset_cache", "on_reset_flushed", "on_schedule_end")
LOOKUP_ANSWERS = ("MISS", "HIT", "HIT_PENDING", "RETRY")


class UnsupportedVllm(ImportError):
    """The installed vLLM lacks what kvd's plug-in needs."""


def _version() -> str:
    try:
        import vllm
    except ImportError as exc:
        raise UnsupportedVllm(f"kvd_client.vllm needs vLLM ({SUPPORTED}); it is not "
                              f"importable: {exc}") from exc
    return str(getattr(vllm, "__version__", "unknown"))


def _module(name: str, modules: dict[str, ModuleType | None] | None) -> ModuleType | None:
    if modules is not None:
        return modules.get(name)
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def missing(modules: dict[str, ModuleType | None] | None = None) -> list[str]:
    """What kvd uses that this vLLM lacks (`modules`: stand-ins by name, for tests)."""
    out = []
    for name, attrs in NAMES.items():
        module = _module(name, modules)
        if module is None:
            out.append(name)
            continue
        out += [f"{name}.{a}" for a in attrs if not hasattr(module, a)]
        if name.endswith(".base"):
            manager = getattr(module, "OffloadingManager", None)
            if manager is not None:
                out += [f"OffloadingManager.{m}" for m in MANAGER_METHODS
                        if not hasattr(manager, m)]
            answers = getattr(module, "LookupResult", None)
            if answers is not None:
                out += [f"LookupResult.{a}" for a in LOOKUP_ANSWERS if not hasattr(answers, a)]
    return out


def check(modules: dict[str, ModuleType | None] | None = None,
          version: str | None = None) -> str:
    """Raise UnsupportedVllm when this vLLM lacks what kvd needs; its version."""
    version = version if version is not None else _version()
    gaps = missing(modules)
    if gaps:
        raise UnsupportedVllm(
            f"kvd_client.vllm supports {SUPPORTED}; the installed vLLM {version} lacks "
            f"{', '.join(gaps[:8])}{' ...' if len(gaps) > 8 else ''}. Install vllm=={TESTED}.* "
            "or a kvd release that supports this vLLM (docs/vllm.md, Supported versions)")
    if not version.startswith(TESTED + "."):
        log.warning("kvd_client.vllm is tested with %s; vLLM %s has every interface kvd uses "
                    "and runs, untested", SUPPORTED, version)
    return version
