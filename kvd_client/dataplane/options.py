"""The data plane's knobs: from vLLM's kv_connector_extra_config, else the environment.

Engine config keys (docs/vllm.md) win over environment variables, which exist for operators
and tests that cannot edit the engine's command line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .chain import CopyMethod

DEFAULT_BLOCKS = 16            # 92-95% of the PCIe limit measured from 16 (H100, issue 13)
MAX_BLOCKS = 1024
DEFAULT_PIN_CHUNK = 256 << 20  # ~13 ms of cudaHostRegister each at ~50 ms/GiB
PIN_CHUNK_ALIGN = 2 << 20      # chunk edges on 2 MiB: never two registrations in one page,
#                                huge pages included

# (config key, environment variable)
BACKEND = ("kvd_copy_backend", "KVD_COPY_BACKEND")
BLOCKS = ("kvd_copy_blocks", "KVD_COPY_BLOCKS")
PIN_CHUNK = ("kvd_pin_chunk_mib", "KVD_PIN_CHUNK_MIB")


@dataclass(frozen=True, slots=True)
class CopyOptions:
    method: CopyMethod | None = None     # None ("auto"): the best the device offers
    blocks: int = DEFAULT_BLOCKS         # thread blocks of one kernel launch
    pin_chunk_bytes: int = DEFAULT_PIN_CHUNK

    @classmethod
    def from_config(cls, extra: Mapping[str, Any],
                    env: Mapping[str, str] | None = None) -> CopyOptions:
        """Parse and check; ValueError names the key and what it accepts."""
        env = os.environ if env is None else env

        def get(knob: tuple[str, str]) -> tuple[str, Any]:
            key, var = knob
            if extra.get(key) is not None:
                return key, extra[key]
            return var, env.get(var)

        name, raw = get(BACKEND)
        method = None
        if raw is not None and str(raw).lower() != "auto":
            try:
                method = CopyMethod(str(raw).lower())
            except ValueError:
                choices = ", ".join(["auto", *(m.value for m in CopyMethod)])
                raise ValueError(f"{name}={raw!r}: use one of {choices}") from None
        blocks = _int(*get(BLOCKS), DEFAULT_BLOCKS, 1, MAX_BLOCKS)
        chunk_mib = _int(*get(PIN_CHUNK), DEFAULT_PIN_CHUNK >> 20, PIN_CHUNK_ALIGN >> 20,
                         1 << 20)
        if (chunk_mib << 20) % PIN_CHUNK_ALIGN:
            raise ValueError(f"{PIN_CHUNK[0]}={chunk_mib}: must be a multiple of "
                             f"{PIN_CHUNK_ALIGN >> 20}")
        return cls(method, blocks, chunk_mib << 20)


def _int(name: str, raw: Any, default: int, low: int, high: int) -> int:
    if raw is None:
        return default
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={raw!r}: not an integer") from None
    if not low <= value <= high:
        raise ValueError(f"{name}={value}: must be in {low}..{high}")
    return value
