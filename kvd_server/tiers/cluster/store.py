"""The cluster store under the cluster tier: Mooncake store, behind the few calls kvd uses.

kvd never builds its own distributed store: blocks shared between nodes live in a Mooncake
store (its master places them in the segments the nodes contribute, replicates and evicts
them, and leases them while they are read). The daemon joins it as a client that may also
contribute a segment of its own memory (`segment_bytes`; 0: a pure client).

Every call here blocks (Mooncake's client waits for its master: 30 s before it gives up on a
master that hangs), and some hold the GIL while they do (`setup` against a master that is
down: 90 s; `close`: ~3 s), so the daemon runs this client in a child process of its own, the
store agent (kvd_server/tiers/cluster/store_agent.py), and calls it from the tier's threads only. Mooncake answers errors as negative codes; they come back here as
`StoreError` with the code and a message.

Mooncake is optional: the `cluster` extra of kvd's distribution, kvd-offload (`pip install
'kvd-offload[cluster]'` into the daemon's environment; x86-64 Linux; its client also needs the
Debian packages libibverbs1 and librdmacm1, even over TCP). Without it the tier reports
itself degraded with the reason, and the daemon serves without it.
"""

from __future__ import annotations

import re
import socket
import threading
from dataclasses import dataclass
from typing import Any, Protocol

# kvd's distribution is kvd-offload: the `kvd` on the package index is another project.
INSTALL_HINT = ("pip install 'kvd-offload[cluster]' into the daemon's environment (Mooncake's "
                "mooncake-transfer-engine-non-cuda) and, on Debian/Ubuntu, apt-get install "
                "libibverbs1 librdmacm1")


class StoreError(Exception):
    """A store call failed: `code` is Mooncake's (negative), or 0 when it raised."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


# Mooncake's TRANSFER_FAIL: the bytes could not move to or from the node holding a replica
# (that node died without leaving its segment, until the master drops it). One object's
# failure, not the store's.
TRANSFER_FAIL = -800


# Mooncake's NO_AVAILABLE_HANDLE ("insufficient space"): the store has no room for this object
# now. A full store is no fault of the store: that one put is refused (the store evicts by
# itself as leases run out); the client and its segment go on.
STORE_FULL = -200


def replica_lost(exc: BaseException) -> bool:
    """Whether a store call failed for its object alone (see TRANSFER_FAIL)."""
    return isinstance(exc, StoreError) and exc.code == TRANSFER_FAIL


def store_full(exc: BaseException) -> bool:
    """Whether a put was refused for room (see STORE_FULL)."""
    return isinstance(exc, StoreError) and exc.code == STORE_FULL


class StoreUnavailable(StoreError):
    """The store's client cannot be loaded or set up (not installed, master unreachable)."""


@dataclass(frozen=True, slots=True)
class StoreConfig:
    master: str                  # the master's host:port
    metadata_url: str            # its metadata server ("http://host:port/metadata")
    protocol: str = "tcp"        # "tcp" or "rdma"
    device: str = ""             # the RDMA device(s), "" over TCP
    local_hostname: str = "127.0.0.1"   # how other nodes reach this one
    segment_bytes: int = 0       # memory this daemon contributes to the store (0: none)
    buffer_bytes: int = 64 << 20  # this client's transfer buffer


class Store(Protocol):
    """What the cluster tier needs of a distributed store."""

    def put(self, name: str, value: bytes) -> None: ...
    def get(self, name: str) -> bytes | bytearray | None: ...     # None: not held
    def exists(self, names: list[str]) -> list[bool]: ...         # one batched call
    def remove_prefix(self, prefix: str) -> None: ...
    def healthy(self) -> bool: ...
    def close(self) -> None: ...


def _load_client() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found]
    except ImportError as exc:
        raise StoreUnavailable(f"the Mooncake client cannot be loaded ({exc}): "
                               f"{INSTALL_HINT}") from exc
    return MooncakeDistributedStore


def _reachable(address: str, timeout_s: float = 2.0) -> None:
    """Fail at once, with the reason, when the master refuses connections (Mooncake's own
    set-up retries a master that is down for ~90 s)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)),
                                      timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise StoreUnavailable(f"the Mooncake master at {address} cannot be reached: "
                               f"{exc}") from exc


class MooncakeStore:
    """A Mooncake store client (see the module doc)."""

    def __init__(self, cfg: StoreConfig) -> None:
        client_type = _load_client()
        _reachable(cfg.master)
        self._client = client_type()
        rc = self._client.setup(cfg.local_hostname, cfg.metadata_url, cfg.segment_bytes,
                                cfg.buffer_bytes, cfg.protocol, cfg.device, cfg.master)
        if rc != 0:
            # The master answered (`_reachable`): the code alone does not say why (-1 for a
            # missing LAN address, RDMA device or metadata server alike); the store agent adds
            # the cause its client logged (store_agent_main.ErrorLog), never a guess here.
            raise StoreUnavailable(f"Mooncake's set-up failed (code {rc}; master {cfg.master}, "
                                   f"metadata {cfg.metadata_url})", rc)
        self._lock = threading.Lock()
        self._closed = False

    def put(self, name: str, value: bytes) -> None:
        # upsert: a block written again (after a reset of another node, say) replaces the
        # old bytes; put would keep them.
        rc = self._client.upsert(name, value)
        if rc != 0:
            raise StoreError(f"put {name}: code {rc}", rc)

    def get(self, name: str) -> bytes | None:
        exists = self._client.is_exist(name)
        if exists == 0:
            return None
        if exists < 0:
            raise StoreError(f"is_exist {name}: code {exists}", exists)
        value = self._client.get(name)
        if not value:                  # gone meanwhile (evicted), or the master is down
            return None
        return bytes(value)

    def exists(self, names: list[str]) -> list[bool]:
        """Which of `names` the store holds, in one call to the master (`batch_is_exist`:
        ~0.2 ms for 64 names on loopback)."""
        answers = self._client.batch_is_exist(names)
        if len(answers) != len(names):
            raise StoreError(f"batch_is_exist answered {len(answers)} of {len(names)} names")
        bad = next((a for a in answers if a < 0), None)
        if bad is not None:
            raise StoreError(f"batch_is_exist: code {bad}", bad)
        return [a == 1 for a in answers]

    def remove_prefix(self, prefix: str) -> None:
        rc = self._client.remove_by_regex("^" + re.escape(prefix))
        if rc < 0:
            raise StoreError(f"remove {prefix}*: code {rc}", rc)

    def healthy(self) -> bool:
        try:
            return self._client.is_exist("kvd/v1/probe") >= 0
        except Exception:  # noqa: BLE001 - a dead client is an unhealthy one
            return False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._client.close()


def open_mooncake(config: dict) -> MooncakeStore:
    """The store agent's factory (kvd_server/tiers/cluster/store_agent.py): a Mooncake client set up
    from StoreConfig's fields."""
    return MooncakeStore(StoreConfig(**config))
