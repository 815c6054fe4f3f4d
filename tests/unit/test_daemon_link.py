"""A session's records on their way out through its one link to the daemon
(kvd_client/offload/daemon_link.py): the compiled calls' records (appended straight to
`records`) and everything `put` keep one order; they go into the outbox as the step's records
when staged, essential when one of them is; nothing is kept for a client that is degraded or
has no channel, nor for a session that ended."""

from __future__ import annotations

from types import SimpleNamespace

from kvd_client.offload.daemon_link import DaemonLink


def link() -> tuple[DaemonLink, SimpleNamespace]:
    client = SimpleNamespace(available=True)
    dl = DaemonLink(client, None, None, None, None)  # type: ignore[arg-type]
    dl.channel = object()              # connected (the outbox is all these tests look at)
    return dl, client


def staged(dl: DaemonLink) -> list[tuple[int, list[bytes], bool]]:
    return [(step.seq, list(step.records), step.essential) for step in dl.outbox._waiting]


def test_appended_and_put_records_keep_their_order_into_the_steps_outbox():
    dl, _ = link()
    post = dl.records.append
    dl.put([b"grant"], essential=False)
    assert not dl.essential
    post(b"store")
    dl.put([b"pin", b"end"])
    post(b"done")
    assert dl.essential and staged(dl) == []
    dl.stage()
    assert staged(dl) == [(0, [b"grant", b"store", b"pin", b"end", b"done"], True)]
    assert dl.records == [] and dl.essential  # staged essential
    post(b"more")                      # the list is the same one: the bound append still works
    dl.seq += 1
    dl.stage()
    assert staged(dl)[-1] == (1, [b"more"], True)


def test_a_step_of_optional_records_only_is_not_essential():
    dl, _ = link()
    dl.put([b"grant", b"counters"], essential=False)
    dl.stage()
    assert staged(dl) == [(0, [b"grant", b"counters"], False)] and not dl.essential


def test_nothing_is_kept_while_degraded_without_a_channel_or_for_an_ended_session():
    dl, client = link()
    client.available = False
    dl.put([b"dropped"])
    assert dl.records == []
    dl.records.append(b"made before it degraded")
    dl.stage()
    assert staged(dl) == [] and dl.records == []
    client.available = True
    dl.channel = None
    dl.put([b"dropped"])
    dl.records.append(b"appended")
    dl.stage()
    assert staged(dl) == [] and dl.records == []
    dl.channel = object()
    dl.put([b"old session"])
    dl.drop()
    dl.put([b"new"], essential=False)
    dl.stage()
    assert staged(dl) == [(0, [b"new"], False)]


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
    dl, _ = link()

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


def test_answers_are_applied_and_refusals_counted_and_logged_at_most_every_interval(caplog):
    """The daemon's answers, read from a real channel: grants top the reserve up, `acked`
    follows what the daemon read, and a refused record is counted and logged (at most once
    per interval), the rest going on; a refused RESET ends the reset the engine awaited."""
    import mmap
    import os

    from kvd_client.link.channel import SessionChannel
    from kvd_client.offload.event_inbox import EventInbox
    from kvd_client.offload.loads import LoadTracker
    from kvd_client.offload.reserve import StoreReserve
    from kvd_client.offload.resets import Resets
    from kvd_client.offload.stores import StoreTracker
    from kvd_proto import records as rec
    from kvd_proto.channel import ChannelHeader, ChannelView

    header = ChannelHeader(8192, 8192)
    fd = os.memfd_create("kvd-test-link", os.MFD_CLOEXEC)
    os.ftruncate(fd, header.file_bytes)
    os.pwrite(fd, header.pack(), 0)
    daemon_map = mmap.mmap(fd, header.file_bytes)
    buf = memoryview(daemon_map)
    daemon = ChannelView(buf, header, engine=False)
    stores, loads, reserve = StoreTracker(), LoadTracker(), StoreReserve()
    resets = Resets(stores, loads)
    client = SimpleNamespace(available=True)
    dl = DaemonLink(client, reserve, EventInbox(), resets, stores)  # type: ignore[arg-type]
    dl.attach(SessionChannel(fd, os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)))
    try:
        resets.ask(dl.put)                            # a RESET record, awaited
        dl.flush()
        dl.next_step()
        assert resets.pending and daemon.reader.read_all()[0][0] == rec.RESET
        daemon.reader.commit()
        for answer in (rec.encode_granted([4096, 8192]),
                       rec.encode_rejected(rec.PIN, "FAILED_PRECONDITION", "stale"),
                       rec.encode_rejected(rec.RESET, "UNAVAILABLE", "draining")):
            assert daemon.writer.write(answer)
        daemon.writer.publish()
        with caplog.at_level("WARNING", logger="kvd_client.offload.daemon_link"):
            dl.receive(per_record=8)
        assert reserve.slots == [4096, 8192] and dl.acked == 0
        assert dl.rejected == 2 and not resets.pending
        assert len([r for r in caplog.records if "kvd rejected a pin" in r.message]) == 1
        assert not any("reset" in r.message for r in caplog.records), "logged within 10 s"
    finally:
        channel = dl.channel
        dl.attach(None)
        channel.close()
        daemon.release()
        buf.release()
        daemon_map.close()
