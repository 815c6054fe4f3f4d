"""A client the daemon refuses at registration leaves no session behind on any try, so a
misconfigured engine cannot use up its uid's session limit for the others."""

from __future__ import annotations

from kvd_client.client import KvdClient
from kvd_proto.wire import KvLayout
from tests.support.waits import wait_until

LAYOUT = KvLayout(4096, 1, 4096, 16, "bfloat16")


def test_a_refused_registration_leaves_no_session_on_any_try(daemon):
    bad = KvdClient(daemon.socket, model="", layout=LAYOUT)   # an empty model: refused
    try:
        assert not bad.wait_available(2.0)
        # Bounded below the daemon's 1 s liveness timeout: past it the sweep would end a
        # session a refused try left behind, and hide it.
        wait_until(lambda: daemon.stats()["clients"]["active"] == 0, 0.8,
                   "the refused tries to leave no session",
                   detail=lambda: f"refused tries left sessions: {daemon.stats()['clients']}")
        good = KvdClient(daemon.socket, model="fine", layout=LAYOUT)
        try:
            assert good.wait_available(10), "another engine of the uid was refused"
        finally:
            good.close()
    finally:
        bad.close()
