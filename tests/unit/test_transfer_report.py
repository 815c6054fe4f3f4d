"""The attach socket's `report` role: its validation, its splitting into request lines, and
the worker-side totals and background sender."""

from __future__ import annotations

import json
import threading

import pytest

from kvd_client.transfer_report import TransferReporter, TransferTotals
from kvd_proto import attach
from kvd_proto.attach import (
    MAX_REQUEST_BYTES,
    ROLE_REPORT,
    AttachError,
    AttachRequest,
    TransferReport,
    encode_request,
    parse_request,
    split_report,
)
from kvd_proto.wire import MAX_TRANSFER_SAMPLES


def line(doc: dict) -> bytes:
    return json.dumps({"version": 1, "role": ROLE_REPORT, **doc}).encode()


def test_a_report_round_trips():
    report = TransferReport(load_bytes=1 << 40, load_seconds=0.25, store_bytes=7,
                            store_seconds=0.0, load_sizes=(1, 2, 3), store_sizes=(7,))
    request = AttachRequest(ROLE_REPORT, "w0", report)
    assert parse_request(encode_request(request).rstrip(b"\n")) == request
    # integers where seconds are expected are fine (JSON has one number type)
    assert parse_request(line({"report": {"load_seconds": 2}})).report.load_seconds == 2.0


@pytest.mark.parametrize("report", [
    {"load_bytes": -1},
    {"load_bytes": 1.5},
    {"load_bytes": True},
    {"load_bytes": 1 << 63},
    {"store_seconds": -0.5},
    {"store_seconds": "1"},
    {"load_sizes": [1, -2]},
    {"load_sizes": [1.0]},
    {"load_sizes": [False]},
    {"store_sizes": "12"},
    {"store_sizes": [0] * (MAX_TRANSFER_SAMPLES + 1)},
    {"bogus": 1},
    [],
])
def test_malformed_reports_are_invalid_argument(report):
    with pytest.raises(AttachError) as err:
        parse_request(line({"report": report}))
    assert err.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("raw", [b'{"version":1,"role":"report","report":{"load_seconds":NaN}}',
                                 b'{"version":1,"role":"report","report":{"load_seconds":'
                                 b'Infinity}}'])
def test_non_finite_seconds_are_refused(raw):
    with pytest.raises(AttachError, match="non-negative finite"):
        parse_request(raw)


def test_report_and_role_come_together():
    for doc in ({"role": ROLE_REPORT}, {"role": "dataplane", "report": {}}):
        with pytest.raises(AttachError, match="comes with role"):
            parse_request(json.dumps({"version": 1, **doc}).encode())


def test_a_large_report_splits_into_lines_within_the_request_limit():
    loads = tuple(range(10**9, 10**9 + 3000))
    stores = tuple(range(5000))[:MAX_TRANSFER_SAMPLES]
    report = TransferReport(123, 1.5, 456, 2.5, loads, stores)
    requests = split_report(report, "engine-0")
    assert len(requests) > 1
    for r in requests:
        raw = encode_request(r)
        assert len(raw) <= MAX_REQUEST_BYTES
        assert parse_request(raw.rstrip(b"\n")) == r
    first, rest = requests[0].report, [r.report for r in requests[1:]]
    assert (first.load_bytes, first.load_seconds, first.store_bytes, first.store_seconds) == \
        (123, 1.5, 456, 2.5)
    assert all((r.load_bytes, r.load_seconds, r.store_bytes, r.store_seconds) == (0, 0, 0, 0)
               for r in rest)
    assert sum((r.report.load_sizes for r in requests), ()) == loads
    assert sum((r.report.store_sizes for r in requests), ()) == stores


def test_an_empty_report_is_one_request():
    assert split_report(TransferReport()) == [AttachRequest(ROLE_REPORT, "", TransferReport())]


def test_totals_keep_exact_bytes_and_bounded_samples():
    totals = TransferTotals()
    assert totals.take() is None
    for _ in range(MAX_TRANSFER_SAMPLES + 10):
        totals.record(is_store=False, size=2, seconds=0.001)
    totals.record(is_store=True, size=5, seconds=-1.0)   # a clock step never goes negative
    report = totals.take()
    assert report.load_bytes == 2 * (MAX_TRANSFER_SAMPLES + 10)
    assert len(report.load_sizes) == MAX_TRANSFER_SAMPLES
    assert report.store_sizes == (5,) and report.store_seconds == 0.0
    assert totals.take() is None


def test_reporter_sends_in_the_background_and_drops_when_the_daemon_is_away():
    sent: list[TransferReport] = []
    arrived = threading.Event()
    fail = [True]

    def sender(path: str, report: TransferReport, timeout: float, engine_id: str) -> None:
        assert (path, engine_id) == ("/x.sock", "e1")
        if fail[0]:
            raise AttachError("UNAVAILABLE", "no daemon")
        sent.append(report)
        arrived.set()

    reporter = TransferReporter("/x.sock", engine_id="e1", interval_s=0.01, sender=sender)
    reporter.record(is_store=True, size=100, seconds=0.5)
    reporter.flush()                              # refused: dropped, not kept for later
    assert reporter.totals.take() is None and not sent
    fail[0] = False
    reporter.record(is_store=False, size=10, seconds=0.1)
    assert arrived.wait(5), "the background thread never sent"
    reporter.record(is_store=False, size=20, seconds=0.2)
    reporter.close()                              # sends what is left
    assert [r.load_sizes for r in sent] == [(10,), (20,)]
    assert sum(r.load_bytes for r in sent) == 30 and reporter.sent_total == 2


def test_send_report_makes_one_exchange_per_split_request(monkeypatch):
    seen: list[AttachRequest] = []
    monkeypatch.setattr(attach, "exchange", lambda path, request, timeout:
                        (seen.append(request) or ({"ok": True}, [])))
    report = TransferReport(load_sizes=tuple(range(10**8, 10**8 + 2000)))
    attach.send_report("/x.sock", report, 1.0)
    assert seen == split_report(report)
