"""The daemon's configuration: embedded defaults < TOML file < `KVD_<SECTION>_<KEY>` env < flags.

Every layer is checked against one schema (`_SCHEMA`), so an unknown key or a bad value fails
the same way wherever it came from, with a message naming the key and its source.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvd_proto.paths import ATTACH_SUFFIX, daemon_socket_path
from kvd_proto.wire import SLOT_ALIGNMENT
from kvd_server import units
from kvd_server.policy_names import POLICY_NAMES

DEFAULTS_PATH = Path(__file__).with_name("default_config.toml")
CONFIG_ENV = "KVD_CONFIG"
ENV_PREFIX = "KVD_"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
BACKINGS = ("memfd", "file")
RESTART_STORES = ("directory", "systemd")
# The tenant of a peer that `tenants.uids` and `tenants.gids` do not map; its pool file is the
# one created at start.
DEFAULT_TENANT = "default"


class ConfigError(ValueError):
    """A configuration problem; the message names the key and where the value came from."""


@dataclass(slots=True, frozen=True)
class ServerConfig:
    socket: str
    socket_mode: int
    allowed_uids: tuple[int, ...]
    allowed_gids: tuple[int, ...]
    admin_uids: tuple[int, ...]
    admin_gids: tuple[int, ...]
    max_sessions: int
    max_sessions_per_uid: int
    max_connections_per_uid: int
    idle_timeout: float
    metrics_port: int
    metrics_address: str
    reflection: bool
    drain_timeout: float
    log_level: str
    log_format: str
    admin_token_file: str
    admin_listen: str
    tls_cert: str
    tls_key: str
    tls_client_ca: str

    @property
    def attach_socket(self) -> str:
        return self.socket + ATTACH_SUFFIX


@dataclass(slots=True, frozen=True)
class PoolConfig:
    size: int
    backing: str
    path: str
    persist: bool
    prefault: bool
    mlock: bool
    extent_size: int  # already capped at the pool size (rounded down to 4 KiB)
    allow_overcommit: bool


@dataclass(slots=True, frozen=True)
class ManagerConfig:
    policy: str
    heartbeat_interval: float
    liveness_timeout: float
    register_timeout: float
    default_lease: float
    max_lease: float


@dataclass(slots=True, frozen=True)
class TenantsConfig:
    uids: dict[str, str] = field(default_factory=dict)
    gids: dict[str, str] = field(default_factory=dict)
    quotas: dict[str, int] = field(default_factory=dict)  # tenant -> bytes of pool
    default_quota: int = 0                                # bytes; 0: no quota
    max_namespaces: int = 64                              # per tenant
    namespace_idle_timeout: float = 0.0                   # seconds; 0: at the next sweep
    max_index_memory: int = 4 << 30                       # bytes of indexes per tenant; 0: none

    def __hash__(self) -> int:  # dict fields: hash the sorted items instead
        return hash((tuple(sorted(self.uids.items())), tuple(sorted(self.gids.items())),
                     tuple(sorted(self.quotas.items())), self.default_quota,
                     self.max_namespaces, self.namespace_idle_timeout, self.max_index_memory))

    def quota_of(self, tenant: str) -> int:
        """Bytes of pool the tenant may hold (0: no limit)."""
        return self.quotas.get(tenant, self.default_quota)


@dataclass(slots=True, frozen=True)
class RetentionConfig:
    """Agent sessions' retention hints (docs/agents.md)."""

    max_share: float        # of a tenant's pool share, what its retained blocks may occupy
    default_s: float        # retention of a hint that names a session but no retain_s
    max_s: float            # the longest retention a hint may ask for (longer: refused)
    max_tag_bytes: int      # the longest session tag a hint may carry


@dataclass(slots=True, frozen=True)
class RestartConfig:
    warm: bool              # the cache outlives the daemon process (kvd_server/restart/)
    store: str              # where its memory files live: "directory" or "systemd"
    directory: str          # with store = "directory": tmpfs, hugetlbfs, a hostPath
    hold_timeout: float     # seconds an engine of the previous daemon, attached again, may
                            # hold freed slots back without saying its copies are done


@dataclass(slots=True, frozen=True)
class DiskTierConfig:
    path: str               # the tier's directory on a local drive ("": no disk tier)
    size: int               # bytes of its data file (preallocated)
    extent_size: int        # its files are cut in extents of this size, one block size each
    io_threads: int         # reads and writes in flight at once
    queue_size: int         # bytes of demotions and promotions in flight; past it, refused
    tenant_quota: int       # bytes a tenant not in tenant_quotas may hold (0: no limit)
    tenant_quotas: dict[str, int] = field(default_factory=dict)   # tenant -> bytes on disk
    retry_interval: float = 30.0    # seconds a degraded tier waits before it tries again
    flush_on_stop: float = 10.0     # seconds a clean stop may spend writing the pool down (0: none)

    def __hash__(self) -> int:  # a dict field: hash the sorted items instead
        return hash((self.path, self.size, self.extent_size, self.io_threads, self.queue_size,
                     self.tenant_quota, tuple(sorted(self.tenant_quotas.items())),
                     self.retry_interval, self.flush_on_stop))

    def quota_of(self, tenant: str) -> int:
        """Bytes of the disk the tenant's blocks may take (0: no limit)."""
        return self.tenant_quotas.get(tenant, self.tenant_quota)


@dataclass(slots=True, frozen=True)
class ClusterTierConfig:
    master: str             # the Mooncake master's host:port ("": no cluster tier)
    metadata_url: str       # its metadata server, e.g. http://master:8080/metadata
    protocol: str           # "tcp" or "rdma"
    device: str             # RDMA device(s) ("" over TCP)
    local_hostname: str     # how the other nodes reach this one ("": this host's name)
    segment_size: int       # memory this daemon contributes to the store (0: a pure client)
    buffer_size: int        # the store client's transfer buffer
    size: int               # bytes of cluster blocks this daemon names to its engines
    publish: str            # "stored": every block once stored; "evicted": when evicted
    io_threads: int         # puts and gets in flight at once (each)
    queue_size: int         # bytes of puts in flight; past it, publications are refused
    sync_interval: float    # how often the store is checked (its health)
    retry_interval: float   # a degraded tier waits this long before it tries again
    node_id: str            # this node's name in the store ("": host name and socket)
    lookup_wait: bool = True    # lookups being asked about answer RETRY, not MISS
    tenants: tuple[str, ...] = ()   # tenants whose blocks are shared (empty: every tenant)

    def shares(self, tenant: str) -> bool:
        """Whether the tenant's namespaces publish to and read from the store."""
        return not self.tenants or tenant in self.tenants


@dataclass(slots=True, frozen=True)
class Config:
    server: ServerConfig
    pool: PoolConfig
    manager: ManagerConfig
    tenants: TenantsConfig
    restart: RestartConfig
    retention: RetentionConfig
    tiers_disk: DiskTierConfig
    tiers_cluster: ClusterTierConfig
    source: str = field(default="", compare=False)  # the TOML file read, "" when none

    def to_dict(self) -> dict[str, Any]:
        """Effective values, JSON-ready: sizes in bytes, durations in seconds, modes as "0660"."""
        out: dict[str, Any] = {}
        for section in _SECTIONS:
            values = {}
            for f in dataclasses.fields(getattr(self, _attr(section))):
                value = getattr(getattr(self, _attr(section)), f.name)
                kind = _SCHEMA[f"{section}.{f.name}"].kind
                if kind == "mode":
                    value = f"{value:04o}"
                elif isinstance(value, tuple):
                    value = list(value)
                elif isinstance(value, dict):
                    value = dict(value)
                values[f.name] = value
            out[section] = values
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def to_toml(self) -> str:
        """Effective values as a TOML file `load_config` reads back to the same Config."""
        lines = [f"# effective kvd configuration (file: {self.source or 'none'})"]
        for section, values in self.to_dict().items():
            lines.append(f"\n[{section}]")
            for key, value in values.items():
                kind = _SCHEMA[f"{section}.{key}"].kind
                lines.append(f"{key} = {_toml_value(kind, value)}")
        return "\n".join(lines) + "\n"


_SECTIONS = ("server", "pool", "manager", "tenants", "restart", "retention", "tiers.disk",
             "tiers.cluster")
_GROUPS = {"tiers"}              # tables that only hold sections: [tiers.disk], [tiers.cluster]


def _attr(section: str) -> str:
    """The Config attribute of a section: `tiers.disk` -> `tiers_disk`."""
    return section.replace(".", "_")


# --- schema --------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class _Key:
    kind: str
    parse: Callable[[Any], Any]


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
    raise ValueError(f"expected true or false, got {value!r}")


def _int(lo: int, hi: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, str):
            try:
                value = int(value.strip(), 10)
            except ValueError:
                raise ValueError(f"expected an integer, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
        if not lo <= value <= hi:
            raise ValueError(f"{value} is out of range {lo}..{hi}")
        return value

    return parse


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = _str(value).strip().lower()
        if text not in options:
            raise ValueError(f"{value!r} is not one of {', '.join(options)}")
        return text

    return parse


def _mode(value: Any) -> int:
    if isinstance(value, str):
        try:
            mode = int(value.strip(), 8)
        except ValueError:
            raise ValueError(f"expected an octal mode like \"0660\", got {value!r}") from None
    elif isinstance(value, int) and not isinstance(value, bool):
        mode = value
    else:
        raise ValueError(f"expected an octal mode like \"0660\", got {value!r}")
    if not 0 <= mode <= 0o777:
        raise ValueError(f"mode {value!r} is out of range 0000..0777")
    return mode


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, str):  # env/flag form: "1000,1001"
        value = [item for item in value.replace(" ", "").split(",") if item]
    if not isinstance(value, list):
        raise ValueError(f"expected a list of ids, got {value!r}")
    parse = _int(0, 2**32 - 1)
    return tuple(parse(item) for item in value)


def _names(value: Any) -> tuple[str, ...]:
    """A list of names (TOML array, or "a,b" from the environment or a flag)."""
    if isinstance(value, str):
        value = [item for item in value.replace(" ", "").split(",") if item]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"expected a list of names, got {value!r}")
    return tuple(value)


def _pairs(value: Any, form: str) -> Any:
    """The env/flag form of a table, "a=1,b=2", as a dict; anything else unchanged."""
    if not isinstance(value, str):
        return value
    pairs: dict[str, str] = {}
    for item in value.split(","):
        if not item.strip():
            continue
        if "=" not in item:
            raise ValueError(f"expected {form} pairs separated by commas, got {value!r}")
        key, val = item.split("=", 1)
        pairs[key.strip()] = val.strip()
    return pairs


def _tenant_map(value: Any) -> dict[str, str]:
    value = _pairs(value, "ID=TENANT")      # "1001=team-a,1002=team-b"
    if not isinstance(value, dict):
        raise ValueError(f"expected a table of id = tenant name, got {value!r}")
    out: dict[str, str] = {}
    for key, name in value.items():
        _int(0, 2**32 - 1)(str(key))
        if not isinstance(name, str) or not 1 <= len(name.encode()) <= 256:
            raise ValueError(f"tenant name for {key!r} must be a string of 1..256 bytes")
        out[str(int(key))] = name
    return out


def _quota_map(value: Any) -> dict[str, int]:
    value = _pairs(value, "TENANT=SIZE")    # "team-a=4GiB,team-b=2GiB"
    if not isinstance(value, dict):
        raise ValueError(f"expected a table of tenant name = size, got {value!r}")
    out: dict[str, int] = {}
    for name, size in value.items():
        if not 1 <= len(str(name).encode()) <= 256:
            raise ValueError(f"tenant name {name!r} must be 1..256 bytes")
        try:
            out[str(name)] = units.parse_size(size)
        except ValueError as exc:
            raise ValueError(f"quota of tenant {name!r}: {exc}") from None
    return out


def _fraction(value: Any) -> float:
    """A number in 0..1 (a share)."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(f"expected a number from 0 to 1, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number from 0 to 1, got {value!r}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{value} is out of range 0..1")
    return float(value)


def _size(value: Any) -> int:
    return units.parse_size(value)


def _duration(value: Any) -> float:
    return units.parse_duration(value)


_SCHEMA: dict[str, _Key] = {
    "server.socket": _Key("str", _str),
    "server.socket_mode": _Key("mode", _mode),
    "server.allowed_uids": _Key("ids", _ids),
    "server.allowed_gids": _Key("ids", _ids),
    "server.admin_uids": _Key("ids", _ids),
    "server.admin_gids": _Key("ids", _ids),
    "server.max_sessions": _Key("int", _int(1, 1_000_000)),
    "server.max_sessions_per_uid": _Key("int", _int(1, 1_000_000)),
    "server.max_connections_per_uid": _Key("int", _int(1, 1_000_000)),
    "server.idle_timeout": _Key("duration", _duration),
    "server.metrics_port": _Key("int", _int(0, 65535)),
    "server.metrics_address": _Key("str", _str),
    "server.reflection": _Key("bool", _bool),
    "server.drain_timeout": _Key("duration", _duration),
    "server.log_level": _Key("str", _choice(LOG_LEVELS)),
    "server.log_format": _Key("str", _choice(LOG_FORMATS)),
    "server.admin_token_file": _Key("str", _str),
    "server.admin_listen": _Key("str", _str),
    "server.tls_cert": _Key("str", _str),
    "server.tls_key": _Key("str", _str),
    "server.tls_client_ca": _Key("str", _str),
    "pool.size": _Key("size", _size),
    "pool.backing": _Key("str", _choice(BACKINGS)),
    "pool.path": _Key("str", _str),
    "pool.persist": _Key("bool", _bool),
    "pool.prefault": _Key("bool", _bool),
    "pool.mlock": _Key("bool", _bool),
    "pool.extent_size": _Key("size", _size),
    "pool.allow_overcommit": _Key("bool", _bool),
    "manager.policy": _Key("str", _choice(POLICY_NAMES)),
    "manager.heartbeat_interval": _Key("duration", _duration),
    "manager.liveness_timeout": _Key("duration", _duration),
    "manager.register_timeout": _Key("duration", _duration),
    "manager.default_lease": _Key("duration", _duration),
    "manager.max_lease": _Key("duration", _duration),
    "tenants.uids": _Key("map", _tenant_map),
    "tenants.gids": _Key("map", _tenant_map),
    "tenants.quotas": _Key("sizemap", _quota_map),
    "tenants.default_quota": _Key("size", _size),
    # At most the daemon-wide limit (namespaces.MAX_NAMESPACES).
    "tenants.max_namespaces": _Key("int", _int(1, 1024)),
    "tenants.namespace_idle_timeout": _Key("duration", _duration),
    "tenants.max_index_memory": _Key("size", _size),
    "restart.warm": _Key("bool", _bool),
    "restart.store": _Key("str", _choice(RESTART_STORES)),
    "restart.directory": _Key("str", _str),
    "restart.hold_timeout": _Key("duration", _duration),
    "retention.max_share": _Key("float", _fraction),
    "retention.default_s": _Key("duration", _duration),
    "retention.max_s": _Key("duration", _duration),
    "retention.max_tag_bytes": _Key("int", _int(1, 1024)),
    "tiers.disk.path": _Key("str", _str),
    "tiers.disk.size": _Key("size", _size),
    "tiers.disk.extent_size": _Key("size", _size),
    "tiers.disk.io_threads": _Key("int", _int(1, 256)),
    "tiers.disk.queue_size": _Key("size", _size),
    "tiers.disk.tenant_quota": _Key("size", _size),
    "tiers.disk.tenant_quotas": _Key("sizemap", _quota_map),
    "tiers.disk.retry_interval": _Key("duration", _duration),
    "tiers.disk.flush_on_stop": _Key("duration", _duration),
    "tiers.cluster.master": _Key("str", _str),
    "tiers.cluster.metadata_url": _Key("str", _str),
    "tiers.cluster.protocol": _Key("str", _choice(("tcp", "rdma"))),
    "tiers.cluster.device": _Key("str", _str),
    "tiers.cluster.local_hostname": _Key("str", _str),
    "tiers.cluster.segment_size": _Key("size", _size),
    "tiers.cluster.buffer_size": _Key("size", _size),
    "tiers.cluster.size": _Key("size", _size),
    "tiers.cluster.publish": _Key("str", _choice(("stored", "evicted"))),
    "tiers.cluster.io_threads": _Key("int", _int(1, 64)),
    "tiers.cluster.queue_size": _Key("size", _size),
    "tiers.cluster.sync_interval": _Key("duration", _duration),
    "tiers.cluster.retry_interval": _Key("duration", _duration),
    "tiers.cluster.node_id": _Key("str", _str),
    "tiers.cluster.lookup_wait": _Key("bool", _bool),
    "tiers.cluster.tenants": _Key("names", _names),
}

KEYS: tuple[str, ...] = tuple(_SCHEMA)


def env_name(key: str) -> str:
    """`pool.extent_size` -> `KVD_POOL_EXTENT_SIZE`."""
    return ENV_PREFIX + key.replace(".", "_").upper()


_ENV_TO_KEY = {env_name(key): key for key in _SCHEMA}


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """` (did you mean X?)` for the closest of `known`, or "" when nothing is close."""
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


# --- loading -------------------------------------------------------------------------------


def _flatten(doc: Mapping[str, Any], source: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section, table in _sections(doc):
        if section not in _SECTIONS:
            hint = did_you_mean(section, _SECTIONS)
            raise ConfigError(f"unknown section [{section}] in {source}{hint}")
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table in {source}")
        for key, value in table.items():
            name = f"{section}.{key}"
            if name not in _SCHEMA:
                raise ConfigError(f"unknown key {name} in {source}{did_you_mean(name, _SCHEMA)}")
            flat[name] = value
    return flat


def _sections(doc: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(section, table) of a parsed file, `[tiers.disk]` as the section "tiers.disk"."""
    out = []
    for name, table in doc.items():
        if name in _GROUPS and isinstance(table, dict):
            for sub, subtable in table.items():
                out.append((f"{name}.{sub}", subtable))
        else:
            out.append((name, table))
    return out


def _read_toml(path: str, source: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist ({source})") from None
    except PermissionError:
        raise ConfigError(f"config file {path} is not readable ({source})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _env_layer(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    layer: dict[str, tuple[Any, str]] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV:
            continue
        key = _ENV_TO_KEY.get(name)
        if key is None:
            # Names under one of our sections (or a misspelt one: KVD_POLL_SIZE) are ours;
            # other KVD_* names (the client's, KVD_SOCKET, ...) are left alone.
            section = name[len(ENV_PREFIX):].split("_", 1)[0].lower()
            ours = (*_SECTIONS, *_GROUPS)
            if section in ours or difflib.get_close_matches(section, ours, n=1):
                raise ConfigError(f"unknown setting in environment variable {name}"
                                  f"{did_you_mean(name, _ENV_TO_KEY)}")
            continue
        layer[key] = (value, f"environment variable {name}")
    return layer


def load_config(
    path: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, tuple[Any, str]] | None = None,
) -> Config:
    """Build the effective Config.

    `path` (or `$KVD_CONFIG` when None) names an optional TOML file; `env` defaults to
    os.environ; `overrides` maps a key (`pool.size`) to (value, source), e.g.
    `("8GiB", "flag --pool-size")`, and wins over everything.
    """
    env = os.environ if env is None else env
    raw: dict[str, tuple[Any, str]] = {}
    defaults = _flatten(_read_toml(str(DEFAULTS_PATH), "embedded defaults"), "embedded defaults")
    for key in _SCHEMA:
        if key not in defaults:  # a developer error: every key must have a default
            raise ConfigError(f"embedded defaults lack {key}")
        raw[key] = (defaults[key], "embedded defaults")

    source = ""
    if path is None and env.get(CONFIG_ENV):
        path, where = env[CONFIG_ENV], f"${CONFIG_ENV}"
    else:
        where = "--config"
    if path:
        source = str(path)
        for key, value in _flatten(_read_toml(source, where), f"config file {source}").items():
            raw[key] = (value, f"config file {source}")
    raw.update(_env_layer(env))
    for key, (value, origin) in (overrides or {}).items():
        if key not in _SCHEMA:
            raise ConfigError(f"unknown key {key} ({origin}){did_you_mean(key, _SCHEMA)}")
        raw[key] = (value, origin)

    values: dict[str, Any] = {}
    for key, (value, origin) in raw.items():
        try:
            values[key] = _SCHEMA[key].parse(value)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc} (from {origin})") from None
    # One rule wherever the path came from: relative to the directory kvd runs in.
    socket = values["server.socket"]
    values["server.socket"] = os.path.abspath(socket) if socket else daemon_socket_path(env)
    _check(values, raw)
    extent_cap = values["pool.size"] // SLOT_ALIGNMENT * SLOT_ALIGNMENT
    values["pool.extent_size"] = min(values["pool.extent_size"], extent_cap)

    sections: dict[str, Any] = {}
    if values["restart.directory"]:
        values["restart.directory"] = os.path.abspath(values["restart.directory"])
    if values["tiers.disk.path"]:
        values["tiers.disk.path"] = os.path.abspath(values["tiers.disk.path"])
    for name, cls in (("server", ServerConfig), ("pool", PoolConfig),
                      ("manager", ManagerConfig), ("tenants", TenantsConfig),
                      ("restart", RestartConfig), ("retention", RetentionConfig),
                      ("tiers.disk", DiskTierConfig),
                      ("tiers.cluster", ClusterTierConfig)):
        kwargs = {k[len(name) + 1:]: v for k, v in values.items() if k.startswith(name + ".")}
        sections[_attr(name)] = cls(**kwargs)
    return Config(**sections, source=source)


def _check(values: dict[str, Any], raw: dict[str, tuple[Any, str]]) -> None:
    """Rules that involve a value's range or two keys."""

    def fail(key: str, message: str) -> None:
        raise ConfigError(f"{key}: {message} (from {raw[key][1]})")

    if values["pool.size"] < SLOT_ALIGNMENT:
        fail("pool.size", f"must be at least {SLOT_ALIGNMENT} bytes")
    extent = values["pool.extent_size"]
    if extent < SLOT_ALIGNMENT or extent % SLOT_ALIGNMENT:
        fail("pool.extent_size", f"must be a positive multiple of {SLOT_ALIGNMENT} bytes")
    if values["pool.backing"] == "file" and not values["pool.path"]:
        # Blame the setting that asked for a file, not the empty default path.
        fail("pool.backing", '"file" needs pool.path, the directory of the pool file (e.g. '
                             "--pool-path /dev/shm or KVD_POOL_PATH)")
    if values["pool.persist"] and values["pool.backing"] != "file":
        fail("pool.persist", 'only applies to pool.backing = "file"')
    if values["restart.warm"]:
        if values["restart.store"] == "directory" and not values["restart.directory"]:
            fail("restart.warm", "needs restart.directory, a directory that outlives the "
                                 "daemon (tmpfs or hugetlbfs, e.g. /dev/shm/kvd; a hostPath "
                                 "in Kubernetes): --restart-dir or KVD_RESTART_DIRECTORY")
        if values["restart.store"] == "systemd" and values["pool.backing"] != "memfd":
            fail("restart.store", '"systemd" keeps memfd pools: leave pool.backing = "memfd"')
        if values["pool.backing"] == "file" or values["pool.persist"]:
            fail("restart.warm", "keeps its own pool files in restart.directory: leave "
                                 "pool.backing, pool.path and pool.persist at their defaults")
    if len((values["server.socket"] + ATTACH_SUFFIX).encode()) > 107:
        fail("server.socket", "is too long for a Unix socket path (at most 100 bytes)")
    for key in ("manager.heartbeat_interval", "manager.liveness_timeout",
                "manager.register_timeout", "server.idle_timeout"):
        if values[key] <= 0:
            fail(key, "must be greater than 0")
    if values["manager.liveness_timeout"] <= values["manager.heartbeat_interval"]:
        fail("manager.liveness_timeout", "must be longer than manager.heartbeat_interval")
    if values["manager.default_lease"] > values["manager.max_lease"]:
        fail("manager.default_lease", "must not exceed manager.max_lease")
    for key in ("manager.heartbeat_interval", "manager.liveness_timeout",
                "manager.default_lease", "manager.max_lease"):
        if values[key] * 1000 > 2**32 - 1:
            fail(key, "is too long (the wire carries it as 32-bit milliseconds)")
    if values["retention.max_s"] * 1000 > 2**32 - 1:
        fail("retention.max_s", "is too long (hints carry it as 32-bit milliseconds)")
    if values["retention.default_s"] > values["retention.max_s"]:
        fail("retention.default_s", "must not exceed retention.max_s")
    listen = values["server.admin_listen"]
    if listen:
        host, sep, port = listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            fail("server.admin_listen", f"must be HOST:PORT (e.g. 0.0.0.0:7443), got {listen!r}")
        for key in ("server.tls_cert", "server.tls_key", "server.admin_token_file"):
            if not values[key]:
                fail(key, "is required when server.admin_listen is set (the TCP listener "
                          "serves only TLS, and only to holders of the admin token)")
    for key in ("server.tls_cert", "server.tls_key", "server.tls_client_ca",
                "server.admin_token_file"):
        if values[key] and not os.path.isabs(values[key]):
            fail(key, f"must be an absolute path, got {values[key]!r}")
    smallest = min(values["pool.extent_size"], values["pool.size"] // SLOT_ALIGNMENT
                   * SLOT_ALIGNMENT)
    for tenant, quota in values["tenants.quotas"].items():
        if quota < smallest:
            fail("tenants.quotas", f"quota of tenant {tenant!r} ({quota} bytes) is smaller "
                                   f"than one extent ({smallest} bytes, pool.extent_size)")
    if values["tiers.disk.path"]:
        disk_extent = values["tiers.disk.extent_size"]
        if disk_extent < 4096 or disk_extent % 4096:
            fail("tiers.disk.extent_size", "must be a positive multiple of 4096 bytes")
        if values["tiers.disk.size"] < disk_extent:
            fail("tiers.disk.size", f"must be at least one extent ({disk_extent} bytes, "
                                    "tiers.disk.extent_size)")
        if values["tiers.disk.queue_size"] < disk_extent // 16:
            fail("tiers.disk.queue_size", "must hold a few blocks: at least "
                                          f"{disk_extent // 16} bytes")
        if not 0.1 <= values["tiers.disk.retry_interval"] <= 3600:
            fail("tiers.disk.retry_interval", "must be between 100ms and 1h")
        if not 0 <= values["tiers.disk.flush_on_stop"] <= 3600:
            fail("tiers.disk.flush_on_stop", "must be between 0 (none) and 1h")
    if values["tiers.cluster.master"]:
        if ":" not in values["tiers.cluster.master"]:
            fail("tiers.cluster.master", "must be host:port (the Mooncake master's RPC port)")
        if not values["tiers.cluster.metadata_url"].startswith(("http://", "https://", "etcd://")):
            fail("tiers.cluster.metadata_url", "must be the metadata server's URL, e.g. "
                 "http://master:8080/metadata")
        node = values["tiers.cluster.node_id"]
        if node and not re.fullmatch(r"[A-Za-z0-9._-]{1,253}", node):
            fail("tiers.cluster.node_id", "letters, digits, '.', '_' and '-' only, at most 253")
        if values["tiers.cluster.size"] < 1 << 20:
            fail("tiers.cluster.size", "must be at least 1MiB")
        if values["tiers.cluster.queue_size"] < 1 << 20:
            fail("tiers.cluster.queue_size", "must be at least 1MiB")
        for key in ("tiers.cluster.sync_interval", "tiers.cluster.retry_interval"):
            if not 0.05 <= values[key] <= 3600:
                fail(key, "must be between 50ms and 1h")
    if 0 < values["tenants.default_quota"] < smallest:
        fail("tenants.default_quota", f"must be 0 (no quota) or at least one extent "
                                      f"({smallest} bytes, pool.extent_size)")


def _toml_value(kind: str, value: Any) -> str:
    if kind == "size":
        text = units.format_size(value)
        return str(value) if "." in text else json.dumps(text)  # a decimal is not exact
    if kind == "duration":
        text = units.format_duration(value)
        return json.dumps(text) if units.parse_duration(text) == value else repr(float(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if kind == "sizemap":
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value('size', v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (int, float, str, list)):
        return json.dumps(value)
    raise TypeError(f"cannot render {value!r}")
