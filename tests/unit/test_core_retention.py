"""Retention hints at the core (kvd_server/core/retention.py), through the call protocol: a
hinted request's stores are retained within its tenant's quota and, with tenants that have no
quota, within max_share of the whole pool together; malformed hints refused and counted; a
release voids older hints; another tenant's release changes nothing."""

from __future__ import annotations

import pytest

from kvd_server.errors import InvalidArgument
from tests.support.core import make_core, protocols, session


def _store(core, s, req: str, n: int, prefix: int) -> None:
    keys = [bytes([prefix, i % 256, i // 256]) * 4 for i in range(n)]
    call = protocols(core).callpath
    answer = call.prepare_store(s, keys, req, None)
    assert not answer.decision.cannot_store
    protocols(core).completions.complete_store(s, answer.decision.keys_to_store, True, req,
                                               answer.epoch)


def _retained(core, tenant: str) -> int:
    return core.retention.tenant_rows().get(tenant, {}).get("retained_blocks", 0)


def test_tenants_without_quotas_retain_max_share_of_the_pool_together():
    core, _ = make_core(pool=4 << 20, extent=512 << 10,
                        **{"tenants.uids": "1001=team-a,1002=team-b"})
    a, b = session(core, uid=1001), session(core, uid=1002)
    slots = (4 << 20) // a.ns.slots.stride                     # what the pool holds
    for s, req, prefix in ((a, "ra", 1), (b, "rb", 2)):
        core.retention.hint(s, req, "agent", 600_000)
        _store(core, s, req, slots // 3, prefix)
    half = slots // 2
    assert _retained(core, "team-a") == slots // 3
    assert _retained(core, "team-a") + _retained(core, "team-b") == half
    assert core.retention.tenant_rows()["team-b"]["cut_blocks_total"] == slots // 3 - (
        half - slots // 3)
    # Another tenant's release of the same session name changes nothing of team-a's.
    assert core.retention.release("agent", "team-b")[0] == half - slots // 3
    assert _retained(core, "team-a") == slots // 3


def test_a_quota_bounds_a_tenant_and_malformed_hints_are_refused():
    core, _ = make_core(pool=4 << 20, extent=512 << 10,
                        **{"tenants.uids": "1001=team-a", "tenants.quotas": "team-a=1MiB",
                           "retention.max_share": "0.25", "retention.max_tag_bytes": "8"})
    a = session(core, uid=1001)
    share = (1 << 20) // 4 // a.ns.slots.stride
    core.retention.hint(a, "r", "s", 0)                         # the default retention
    _store(core, a, "r", share + 5, 3)
    assert _retained(core, "team-a") == share
    for args in (("r2", "x" * 9, 1000), ("r3", "s", 3_600_001), ("", "s", 1000),
                 ("r4", "a\nb", 1000)):
        with pytest.raises(InvalidArgument):
            core.retention.hint(a, *args)
    assert core.retention.hints_refused_total == 4 and core.retention.hints_total == 1
    # A release voids the hints given before it: later stores of that request retain none.
    assert core.retention.release("s", "team-a")[0] == share
    _store(core, a, "r", 4, 4)
    assert _retained(core, "team-a") == 0
