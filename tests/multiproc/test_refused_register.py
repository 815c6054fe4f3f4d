"""A client the daemon refuses at registration leaves no session behind on any try, so a
misconfigured engine cannot use up its uid's session limit for the others."""

from __future__ import annotations

import time

from kvd_client.client import KvdClient
from kvd_proto.wire import KvLayout

LAYOUT = KvLayout(4096, 1, 4096, 16, "bfloat16")


def test_a_refused_registration_leaves_no_session_on_any_try(daemon):
    bad = KvdClient(daemon.socket, model="", layout=LAYOUT)   # an empty model: refused
    try:
        assert not bad.wait_available(2.0)
        time.sleep(0.3)
        clients = daemon.stats()["clients"]
        assert clients["active"] == 0, f"refused tries left sessions: {clients}"
        good = KvdClient(daemon.socket, model="fine", layout=LAYOUT)
        try:
            assert good.wait_available(10), "another engine of the uid was refused"
        finally:
            good.close()
    finally:
        bad.close()
