"""Admin tokens and the static token file; the admin listener's configuration rules."""

from __future__ import annotations

import os

import pytest

from kvd_server.config import ConfigError, load_config
from kvd_server.rpc.admin_tokens import (
    MAX_ADMIN_TOKENS,
    AdminTokens,
    TokenFileError,
    read_token_file,
)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_issued_tokens_expire_and_are_bounded():
    clock = Clock()
    tokens = AdminTokens(clock=clock, ttl=10)
    first = tokens.issue()
    assert tokens.valid(first) and not tokens.valid("") and not tokens.valid("x" * 64)
    clock.now += 11
    assert not tokens.valid(first)
    issued = [tokens.issue() for _ in range(MAX_ADMIN_TOKENS + 5)]
    assert len(tokens) == MAX_ADMIN_TOKENS
    assert not tokens.valid(issued[0]) and tokens.valid(issued[-1])


def test_static_token_is_accepted_besides_issued_ones():
    tokens = AdminTokens("s" * 32)
    assert tokens.valid("s" * 32) and not tokens.valid("s" * 31)
    assert tokens.valid(tokens.issue())


def test_token_file_rules(tmp_path):
    path = tmp_path / "tok"
    path.write_text("  abcdefghijklmnopqrstuvwxyz  \nsecond line ignored\n")
    os.chmod(path, 0o600)
    assert read_token_file(str(path)) == "abcdefghijklmnopqrstuvwxyz"
    path.write_text("short\n")
    with pytest.raises(TokenFileError, match="16"):
        read_token_file(str(path))
    path.write_text("")
    with pytest.raises(TokenFileError, match="16"):
        read_token_file(str(path))
    path.write_text("a" * 40)
    os.chmod(path, 0o666)
    with pytest.raises(TokenFileError, match="writable by everyone"):
        read_token_file(str(path))
    with pytest.raises(TokenFileError, match="does not exist"):
        read_token_file(str(tmp_path / "missing"))


@pytest.mark.parametrize("overrides, message", [
    ({"server.admin_listen": "7443"}, "HOST:PORT"),
    ({"server.admin_listen": "0.0.0.0:99999"}, "HOST:PORT"),
    ({"server.admin_listen": "0.0.0.0:7443"}, "server.tls_cert: is required"),
    ({"server.admin_listen": "0.0.0.0:7443", "server.tls_cert": "/c", "server.tls_key": "/k"},
     "server.admin_token_file: is required"),
    ({"server.tls_cert": "cert.pem"}, "absolute path"),
    ({"tenants.quotas": "team-a"}, "TENANT=SIZE"),
    ({"tenants.quotas": {"team-a": "lots"}}, "quota of tenant"),
    ({"tenants.default_quota": "1KiB"}, "at least one extent"),
])
def test_admin_listener_and_quota_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, env={}, overrides={k: (v, "test") for k, v in overrides.items()})


def test_quota_settings_round_trip_through_toml(tmp_path):
    cfg = load_config(None, env={"KVD_TENANTS_QUOTAS": "team-a=4GiB,team-b=100663296",
                                 "KVD_TENANTS_DEFAULT_QUOTA": "1GiB"})
    assert cfg.tenants.quotas == {"team-a": 4 << 30, "team-b": 96 << 20}
    assert cfg.tenants.quota_of("team-b") == 96 << 20 and cfg.tenants.quota_of("x") == 1 << 30
    path = tmp_path / "kvd.toml"
    path.write_text(cfg.to_toml())
    assert load_config(str(path), env={}).tenants == cfg.tenants
