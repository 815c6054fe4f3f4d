"""A daemon's core in one process, no sockets: the core, its clock, and the engine protocols
over it as the daemon wires them (kvd_server/protocols/wiring.py), for the unit tests of the
core, the protocols and the channel's servicer."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from kvd_proto.wire import KvLayout
from kvd_server.config import load_config
from kvd_server.core.core import KvdCore
from kvd_server.core.peer import PeerCred
from kvd_server.core.sessions import EngineInfo, Session
from kvd_server.memory.extents import ExtentAllocator
from kvd_server.ops.snapshot import build_snapshot
from kvd_server.protocols.wiring import EngineProtocols

LAYOUT = KvLayout(block_bytes=8192, num_ranks=2, shard_bytes=4096, tokens_per_block=16,
                  dtype="bf16")

_WIRED: weakref.WeakKeyDictionary[KvdCore, EngineProtocols] = weakref.WeakKeyDictionary()


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_core(pool: int = 1 << 20, extent: int = 256 << 10,
              alive: Callable[[int], bool] = lambda pid: False,
              **overrides: Any) -> tuple[KvdCore, Clock]:
    """A serving core; by default every peer's process counts as gone once its session ends
    (`alive`), as for an engine that exited."""
    ov = {"pool.size": (str(pool), "test"), "pool.extent_size": (str(extent), "test"),
          "manager.liveness_timeout": ("5s", "test")}
    ov.update({k: (v, "test") for k, v in overrides.items()})
    cfg = load_config(None, env={}, overrides=ov)
    clock = Clock()
    core = KvdCore(cfg, ExtentAllocator(cfg.pool.size, cfg.pool.extent_size), clock=clock,
                   alive=alive)
    core.set_serving()
    return core, clock


def protocols(core: KvdCore) -> EngineProtocols:
    """The engine protocols over `core` (no tier below), built once per core."""
    wired = _WIRED.get(core)
    if wired is None:
        wired = _WIRED[core] = EngineProtocols.over(core)
    return wired


def session(core: KvdCore, uid: int = 1000, model: str = "m",
            layout: KvLayout = LAYOUT) -> Session:
    """A registered session of a peer of `uid`."""
    s = core.attach(PeerCred(pid=1, uid=uid, gid=uid))
    assert s is not None
    core.register(s, EngineInfo(engine_id="e"), model, layout, "")
    return s


def stats(core: KvdCore) -> dict[str, Any]:
    return build_snapshot(core).to_dict()


def keys(*ints: int) -> list[bytes]:
    return [bytes([i]) * 8 for i in ints]
