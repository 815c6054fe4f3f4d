"""Configuration: embedded defaults, precedence, validation messages and rendering."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from kvd_proto.paths import daemon_socket_path
from kvd_server.config import (
    DEFAULTS_PATH,
    KEYS,
    Config,
    ConfigError,
    env_name,
    load_config,
)

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvd.toml"
    path.write_text(text)
    return str(path)


def test_defaults_match_the_documented_keys():
    cfg = load_config(env={"XDG_RUNTIME_DIR": "/run/user/1000"})
    assert cfg.server.socket == "/run/user/1000/kvd/kvd.sock"
    assert cfg.server.attach_socket == "/run/user/1000/kvd/kvd.sock.attach"
    assert cfg.server.socket_mode == 0o660
    assert cfg.server.allowed_uids == () and cfg.server.admin_gids == ()
    assert cfg.server.max_sessions == 1024
    assert cfg.server.metrics_port == 0 and cfg.server.metrics_address == "127.0.0.1"
    assert cfg.server.reflection is False
    assert cfg.server.drain_timeout == 30.0
    assert cfg.server.log_level == "info" and cfg.server.log_format == "text"
    assert cfg.pool.size == 1 << 30 and cfg.pool.backing == "memfd" and cfg.pool.path == ""
    assert cfg.pool.persist is False and cfg.pool.prefault is True and cfg.pool.mlock is False
    assert cfg.pool.extent_size == 64 << 20
    m = cfg.manager
    assert (m.policy, m.heartbeat_interval, m.liveness_timeout) == ("lru", 1.0, 10.0)
    assert (m.default_lease, m.max_lease) == (2.0, 30.0)
    assert cfg.tenants.uids == {} and cfg.tenants.gids == {}
    assert cfg.source == ""


def test_every_default_key_is_commented_and_documented():
    text = DEFAULTS_PATH.read_text()
    lines = text.splitlines()
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for key in KEYS:
        name = key.rsplit(".", 1)[1]
        index = next(i for i, line in enumerate(lines) if line.startswith(f"{name} ="))
        while lines[index - 1] and lines[index - 1][0].isalpha():  # a group of related keys
            index -= 1
        assert lines[index - 1].startswith("#"), f"{key} has no comment in default_config.toml"
        assert f"`{key}`" in doc, f"{key} missing from docs/configuration.md"
        assert env_name(key) in doc, f"{env_name(key)} missing from docs/configuration.md"


def test_socket_default_rule():
    assert daemon_socket_path({"XDG_RUNTIME_DIR": "/run/user/7"}) == "/run/user/7/kvd/kvd.sock"
    assert re.fullmatch(r"/tmp/kvd-\d+/kvd\.sock", daemon_socket_path({}))


def test_relative_socket_is_taken_from_the_current_directory_wherever_it_is_set(
        tmp_path, monkeypatch):
    """One rule for a relative server.socket: file, environment and flag alike."""
    monkeypatch.chdir(tmp_path)
    expected = str(tmp_path / "run" / "kvd.sock")
    path = write(tmp_path, '[server]\nsocket = "run/kvd.sock"\n')
    assert load_config(path, env={}).server.socket == expected
    assert load_config(env={"KVD_SERVER_SOCKET": "run/kvd.sock"}).server.socket == expected
    assert load_config(env={}, overrides={"server.socket": ("run/kvd.sock", "flag --socket")}
                       ).server.socket == expected


def test_precedence_file_env_flag(tmp_path):
    path = write(tmp_path, '[pool]\nsize = "256MiB"\n[manager]\npolicy = "arc"\n')
    cfg = load_config(path, env={})
    assert cfg.pool.size == 256 << 20 and cfg.manager.policy == "arc"
    assert cfg.source == path
    cfg = load_config(path, env={"KVD_POOL_SIZE": "128MiB"})
    assert cfg.pool.size == 128 << 20 and cfg.manager.policy == "arc"
    cfg = load_config(path, env={"KVD_POOL_SIZE": "128MiB"},
                      overrides={"pool.size": ("64MiB", "flag --pool-size")})
    assert cfg.pool.size == 64 << 20


def test_kvd_config_env_names_the_file(tmp_path):
    path = write(tmp_path, '[server]\nmax_sessions = 8\n')
    assert load_config(env={"KVD_CONFIG": path}).server.max_sessions == 8
    # An explicit path wins over $KVD_CONFIG.
    other = tmp_path / "other.toml"
    other.write_text("[server]\nmax_sessions = 9\n")
    assert load_config(str(other), env={"KVD_CONFIG": path}).server.max_sessions == 9


def test_env_forms_for_lists_bools_and_maps():
    cfg = load_config(env={
        "KVD_SERVER_ALLOWED_UIDS": "1000, 1001",
        "KVD_SERVER_REFLECTION": "yes",
        "KVD_TENANTS_UIDS": "1001=team-a,1002=team-b",
        "KVD_SERVER_SOCKET_MODE": "0600",
        "KVD_SOMETHING_ELSE": "ignored: not one of our sections",
    })
    assert cfg.server.allowed_uids == (1000, 1001)
    assert cfg.server.reflection is True
    assert cfg.tenants.uids == {"1001": "team-a", "1002": "team-b"}
    assert cfg.server.socket_mode == 0o600


def test_extent_is_capped_at_the_pool_size():
    cfg = load_config(env={"KVD_POOL_SIZE": "16MiB"})
    assert cfg.pool.extent_size == 16 << 20


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[pool]\nsize = \"lots\"\n", r"pool\.size: .*'lots'.* \(from config file .*kvd\.toml\)"),
        ("[pool]\nsise = \"1GiB\"\n",
         r"unknown key pool\.sise in config file .* \(did you mean pool\.size\?\)"),
        ("[poool]\n", r"unknown section \[poool\] in .* \(did you mean pool\?\)"),
        ("[server]\nlog_levle = \"debug\"\n", r"did you mean server\.log_level\?"),
        ("[server]\nlog_format = \"xml\"\n", r"server\.log_format: 'xml' is not one of text, json"),
        ("[manager]\npolicy = \"fifo\"\n", r"manager\.policy: 'fifo' is not one of lru, arc"),
        ("[server]\nsocket_mode = \"0999\"\n", r"server\.socket_mode: expected an octal mode"),
        ("[server]\nmetrics_port = 70000\n", r"server\.metrics_port: 70000 is out of range"),
        ("[server]\nreflection = \"maybe\"\n", r"server\.reflection: expected true or false"),
        ("[pool]\nbacking = \"file\"\n",
         r"pool\.backing: \"file\" needs pool\.path, .* \(from config file .*kvd\.toml\)"),
        ("[pool]\nextent_size = \"1000\"\n", r"pool\.extent_size: must be a positive multiple"),
        ("[manager]\nliveness_timeout = \"1s\"\nheartbeat_interval = \"2s\"\n",
         r"manager\.liveness_timeout: must be longer than manager\.heartbeat_interval"),
        ("[manager]\ndefault_lease = \"1m\"\n", r"manager\.default_lease: must not exceed"),
        ("[tenants]\nuids = {alice = \"a\"}\n", r"tenants\.uids: expected an integer"),
        ("[pool\n", r"not valid TOML"),
    ],
)
def test_bad_file_values_name_key_and_source(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=fragment):
        load_config(path, env={})


def test_bad_env_and_flag_values_name_their_source():
    with pytest.raises(ConfigError, match=r"pool\.size: .* \(from environment variable "
                                          r"KVD_POOL_SIZE\)"):
        load_config(env={"KVD_POOL_SIZE": "12XB"})
    with pytest.raises(ConfigError, match=r"unknown setting in environment variable "
                                          r"KVD_SERVER_SOCKETS \(did you mean "
                                          r"KVD_SERVER_SOCKET\?\)"):
        load_config(env={"KVD_SERVER_SOCKETS": "/x"})
    with pytest.raises(ConfigError, match=r"pool\.backing: .* \(from flag --pool-backing\)"):
        load_config(env={}, overrides={"pool.backing": ("file", "flag --pool-backing")})
    with pytest.raises(ConfigError, match=r"manager\.policy: .* \(from flag --policy\)"):
        load_config(env={}, overrides={"manager.policy": ("mru", "flag --policy")})


@pytest.mark.parametrize(("name", "suggestion"), [("KVD_POLL_SIZE", "KVD_POOL_SIZE"),
                                                ("KVD_TENANT_UIDS", "KVD_TENANTS_UIDS"),
                                                ("KVD_MANAGER_POLICI", "KVD_MANAGER_POLICY")])
def test_misspelt_environment_variables_are_refused_with_the_close_match(name, suggestion):
    with pytest.raises(ConfigError, match=rf"{name} \(did you mean {suggestion}\?\)"):
        load_config(env={name: "1"})


def test_other_kvd_variables_are_left_alone():
    env = {"KVD_SOCKET": "/x/kvd.sock", "KVD_ADMIN_TOKEN_FILE": "/t", "KVD_CLIENT_STEP_STREAM": "0",
           "KVD_SOAK_ROUNDS": "3"}
    assert load_config(env=env).server.socket == "/x/kvd.sock"


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist \(--config\)"):
        load_config(str(tmp_path / "nope.toml"), env={})
    with pytest.raises(ConfigError, match=r"does not exist \(\$KVD_CONFIG\)"):
        load_config(env={"KVD_CONFIG": str(tmp_path / "nope.toml")})


def test_toml_rendering_round_trips(tmp_path):
    cfg = load_config(env={
        "KVD_SERVER_SOCKET": "/tmp/x/kvd.sock",
        "KVD_POOL_SIZE": "1000000000",
        "KVD_MANAGER_DEFAULT_LEASE": "1.25s",
        "KVD_MANAGER_LIVENESS_TIMEOUT": "1500ms",
        "KVD_TENANTS_GIDS": "50=ops",
        "KVD_SERVER_ADMIN_UIDS": "0,7",
    })
    text = cfg.to_toml()
    tomllib.loads(text)
    again = load_config(write(tmp_path, text), env={})
    assert again == cfg
    assert isinstance(again, Config)


def test_dict_rendering_is_json_with_base_units():
    cfg = load_config(env={"KVD_SERVER_SOCKET": "/tmp/x/kvd.sock"})
    doc = json.loads(cfg.to_json())
    assert doc == cfg.to_dict()
    assert doc["pool"]["size"] == 1 << 30
    assert doc["manager"]["liveness_timeout"] == 10.0
    assert doc["server"]["socket_mode"] == "0660"
    assert set(doc) == {"server", "pool", "manager", "tenants", "restart", "retention", "tiers.disk",
                        "tiers.cluster"}
    assert sum(len(v) for v in doc.values()) == len(KEYS)


def test_disk_tier_quotas_per_tenant_with_a_default_for_the_rest(tmp_path):
    cfg = tmp_path / "kvd.toml"
    cfg.write_text('[tiers.disk]\ntenant_quota = "8GiB"\n'
                   'tenant_quotas = {"team-a" = "100GiB", "team-b" = "2GiB"}\n')
    disk = load_config(str(cfg), env={}).tiers_disk
    assert disk.quota_of("team-a") == 100 << 30 and disk.quota_of("team-b") == 2 << 30
    assert disk.quota_of("anyone-else") == 8 << 30
    env = load_config(None, env={"KVD_TIERS_DISK_TENANT_QUOTAS": "team-c=1GiB"}).tiers_disk
    assert env.quota_of("team-c") == 1 << 30 and env.quota_of("team-a") == 0
    with pytest.raises(ConfigError, match="tenant_quotas"):
        load_config(None, env={"KVD_TIERS_DISK_TENANT_QUOTAS": "team-c=lots"})


def test_disk_tier_retry_interval_is_a_bounded_duration():
    assert load_config(None, env={}).tiers_disk.retry_interval == 30.0
    env = {"KVD_TIERS_DISK_RETRY_INTERVAL": "2s"}
    assert load_config(None, env=env).tiers_disk.retry_interval == 2.0
    with pytest.raises(ConfigError, match="retry_interval"):
        load_config(None, env={"KVD_TIERS_DISK_RETRY_INTERVAL": "10ms",
                               "KVD_TIERS_DISK_PATH": "/tmp/x"})
