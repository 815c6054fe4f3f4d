"""A session's records on their way out (kvd_client/offload/daemon_link.py): the compiled calls'
records (appended straight to `records`) and everything `put` keep one order; they go into the
outbox as the step's records when staged, essential when one of them is; nothing is kept for
a client that is degraded or has no channel, nor for a session that ended."""

from __future__ import annotations

from types import SimpleNamespace

from kvd_client.link.channel import Messenger
from kvd_client.offload.daemon_link import DaemonLink


def link() -> tuple[DaemonLink, Messenger, SimpleNamespace]:
    client = SimpleNamespace(available=True)
    msgs = Messenger()
    msgs.channel = object()            # connected (the outbox is all these tests look at)
    return DaemonLink(client, msgs, None, None, None, None), msgs, client  # type: ignore[arg-type]


def staged(msgs: Messenger) -> list[tuple[int, list[bytes], bool]]:
    return [(step.seq, list(step.records), step.essential) for step in msgs.outbox._waiting]


def test_appended_and_put_records_keep_their_order_into_the_steps_outbox():
    dl, msgs, _ = link()
    post = dl.records.append
    dl.put([b"grant"], essential=False)
    assert not dl.essential
    post(b"store")
    dl.put([b"pin", b"end"])
    post(b"done")
    assert dl.essential and staged(msgs) == []
    dl.stage()
    assert staged(msgs) == [(0, [b"grant", b"store", b"pin", b"end", b"done"], True)]
    assert dl.records == [] and msgs.essential
    post(b"more")                      # the list is the same one: the bound append still works
    msgs.seq += 1
    dl.stage()
    assert staged(msgs)[-1] == (1, [b"more"], True)


def test_a_step_of_optional_records_only_is_not_essential():
    dl, msgs, _ = link()
    dl.put([b"grant", b"counters"], essential=False)
    dl.stage()
    assert staged(msgs) == [(0, [b"grant", b"counters"], False)] and not msgs.essential


def test_nothing_is_kept_while_degraded_without_a_channel_or_for_an_ended_session():
    dl, msgs, client = link()
    client.available = False
    dl.put([b"dropped"])
    assert dl.records == []
    dl.records.append(b"made before it degraded")
    dl.stage()
    assert staged(msgs) == [] and dl.records == []
    client.available = True
    msgs.channel = None
    dl.put([b"dropped"])
    dl.records.append(b"appended")
    dl.stage()
    assert staged(msgs) == [] and dl.records == []
    msgs.channel = object()
    dl.put([b"old session"])
    dl.drop()
    dl.put([b"new"], essential=False)
    dl.stage()
    assert staged(msgs) == [(0, [b"new"], False)]


def test_lookup_counts_go_at_most_every_interval_while_stepping_and_at_once_when_asked(
        monkeypatch):
    """A COUNTERS record every step was most quiet steps' only record (each woke an idle
    daemon): a step's end reports at most every COUNTS_INTERVAL_S, a forced report (the
    session asked whether work is pending, or closes) at once; each carries the change since
    the last one, so the daemon's totals end up exact."""
    from kvd_client.offload import daemon_link
    from kvd_proto import records as rec

    clock = [100.0]
    monkeypatch.setattr(daemon_link.time, "monotonic", lambda: clock[0])
    dl, msgs, _ = link()

    def sent() -> list[tuple[int, int, int]]:
        out = []
        for record in dl.records:
            counters = rec.decode_up(rec.COUNTERS, record[8:])   # after the record header
            out.append((counters.lookups, counters.hits, counters.misses))
        dl.records.clear()
        return out

    dl.report_counts((4, 3, 1), at_once=False)
    assert sent() == [(4, 3, 1)]                     # the first one goes
    dl.report_counts((9, 7, 2), at_once=False)
    dl.report_counts((12, 9, 3), at_once=False)
    assert sent() == []                              # within the interval: held
    clock[0] += daemon_link.COUNTS_INTERVAL_S
    dl.report_counts((12, 9, 3), at_once=False)
    assert sent() == [(8, 6, 2)]                     # the change since the last report
    dl.report_counts((15, 11, 4))                    # forced: at once
    assert sent() == [(3, 2, 1)]
    dl.report_counts((15, 11, 4))                    # nothing moved: nothing sent
    assert sent() == []
