"""The eviction policies' names have one list, kvd_server/policy_names.py: the configuration
accepts exactly those, and the manager has a policy class under each (named so itself)."""

from __future__ import annotations

import pytest

from kvd_server.config import ConfigError, load_config
from kvd_server.manager.policies import POLICIES
from kvd_server.policy_names import POLICY_NAMES


def test_the_manager_has_a_policy_under_each_name_and_no_other() -> None:
    assert tuple(POLICIES) == POLICY_NAMES
    assert {name: cls.name for name, cls in POLICIES.items()} == dict(zip(POLICY_NAMES,
                                                                          POLICY_NAMES))


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_the_configuration_accepts_each_name(name: str) -> None:
    assert load_config(env={"KVD_MANAGER_POLICY": name}).manager.policy == name


def test_the_configuration_names_them_all_when_refusing_another() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(env={"KVD_MANAGER_POLICY": "fifo"})
    assert all(name in str(refused.value) for name in POLICY_NAMES)
