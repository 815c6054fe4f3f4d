"""A data-plane worker's transfer report (attach role `report`) moves a live daemon's
transfer totals and its `kvd_transfer_*` metrics, and a malformed one is refused."""

from __future__ import annotations

import json
import socket
import struct

import pytest

from kvd_client.transfer_report import TransferReporter
from kvd_proto.paths import attach_path
from kvd_proto.wire import MAX_TRANSFER_SAMPLES
from tests.support.metrics import free_port, scrape, value

pytestmark = pytest.mark.multiproc


def test_worker_reports_move_the_daemons_transfer_stats_and_metrics(start_daemon):
    port = free_port()
    daemon = start_daemon("--pool-size", "4MiB", "--extent-size", "1MiB",
                          "--metrics-port", str(port))
    reporter = TransferReporter(daemon.socket, engine_id="w0", interval_s=60)
    for _ in range(3):
        reporter.record(is_store=True, size=4 << 20, seconds=0.5)
    for _ in range(MAX_TRANSFER_SAMPLES + 1000):     # more samples than one report carries
        reporter.record(is_store=False, size=3 << 20, seconds=0.001)
    reporter.flush()
    loads = MAX_TRANSFER_SAMPLES + 1000
    t = daemon.stats()["transfers"]
    assert t["store_bytes_total"] == 3 * (4 << 20)
    assert t["store_seconds_total"] == pytest.approx(1.5)
    assert t["load_bytes_total"] == loads * (3 << 20)
    assert t["load_seconds_total"] == pytest.approx(loads * 0.001)
    text = scrape(port)
    assert value(text, "kvd_transfer_store_bytes_total") == 3 * (4 << 20)
    assert value(text, 'kvd_transfer_size_bytes_count{transfer_type="GPU_to_CPU"}') == 3
    # samples beyond one period's bound are dropped; the byte totals above stay exact
    assert value(text, 'kvd_transfer_size_bytes_count{transfer_type="CPU_to_GPU"}') == \
        MAX_TRANSFER_SAMPLES
    assert value(text, 'kvd_transfer_size_bytes_bucket{le="5e+06",'
                 'transfer_type="CPU_to_GPU"}') == MAX_TRANSFER_SAMPLES
    reporter.close()


def test_a_malformed_report_is_refused_and_changes_nothing(daemon):
    doc = {"version": 1, "role": "report", "report": {"load_bytes": -5}}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(attach_path(daemon.socket))
        sock.sendall(json.dumps(doc).encode() + b"\n")
        (n,) = struct.unpack(">I", sock.recv(4))
        answer = json.loads(sock.recv(n))
    assert answer["ok"] is False and answer["code"] == "INVALID_ARGUMENT"
    assert "load_bytes" in answer["error"]
    assert daemon.stats()["transfers"]["load_bytes_total"] == 0
