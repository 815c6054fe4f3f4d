"""The engine protocols over one core, as the daemon wires them.

The core (kvd_server/core/) knows sessions, namespaces and leases; the operations of the two
engine protocols stand above it, and so does the tier below the pool that a lookup's miss may
promote from. The daemon's wiring (kvd_server/server.py) builds them here, once, over its core
and its tier link, and hands them to the ways in (gRPC, the channel, the attach socket).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvd_server.protocols.callpath import Below, CallPath
from kvd_server.protocols.completions import Completions
from kvd_server.protocols.fastpath import FastPath

if TYPE_CHECKING:
    from kvd_server.core.core import KvdCore


@dataclass(frozen=True, slots=True)
class EngineProtocols:
    """The call protocol, the shared-index protocol and the completions both end in."""

    callpath: CallPath
    fastpath: FastPath
    completions: Completions

    @classmethod
    def over(cls, core: KvdCore, below: Below | None = None) -> EngineProtocols:
        """The protocols' operations over `core`; `below` (the tier link) promotes what only
        a tier under the pool holds, None without a tier."""
        return cls(CallPath(core, below), FastPath(core, below), Completions(core))
