"""A data-plane worker's transfer totals, handed to the daemon in the background.

A worker has no session, so it reports through the attach socket (role `report`,
docs/attach.md). Recording is a lock and an append; a background thread sends what was
recorded at most once per interval, so the copy path never waits on the daemon. Reports that
cannot be delivered (daemon down or restarting) are dropped: a new daemon starts new totals.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvd_proto.attach import AttachError, TransferReport, send_report
from kvd_proto.wire import MAX_TRANSFER_SAMPLES

log = logging.getLogger(__name__)

Sender = Callable[[str, TransferReport, float, str], None]


class TransferTotals:
    """Bytes, seconds and per-transfer sizes since the last `take` (samples bounded)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.load_bytes = self.store_bytes = 0
        self.load_seconds = self.store_seconds = 0.0
        self.load_sizes: list[int] = []
        self.store_sizes: list[int] = []

    def record(self, *, is_store: bool, size: int, seconds: float) -> None:
        seconds = max(0.0, seconds)
        with self._lock:
            if is_store:
                self.store_bytes += size
                self.store_seconds += seconds
                sizes = self.store_sizes
            else:
                self.load_bytes += size
                self.load_seconds += seconds
                sizes = self.load_sizes
            if len(sizes) < MAX_TRANSFER_SAMPLES:   # beyond: totals stay exact, samples not
                sizes.append(size)

    def take(self) -> TransferReport | None:
        """What was recorded since the last call (None if nothing), and start afresh."""
        with self._lock:
            if not (self.load_sizes or self.store_sizes or self.load_bytes or self.store_bytes):
                return None
            report = TransferReport(self.load_bytes, self.load_seconds, self.store_bytes,
                                    self.store_seconds, tuple(self.load_sizes),
                                    tuple(self.store_sizes))
            self._reset()
        return report


class TransferReporter:
    """Sends `TransferTotals` to the daemon from a background thread, once per interval."""

    def __init__(self, socket_path: str, *, engine_id: str = "", interval_s: float = 1.0,
                 timeout_s: float = 1.0, sender: Sender = send_report) -> None:
        self.socket_path = socket_path
        self.engine_id = engine_id
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.totals = TransferTotals()
        self.sent_total = 0
        self._send = sender
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def record(self, *, is_store: bool, size: int, seconds: float) -> None:
        self.totals.record(is_store=is_store, size=size, seconds=seconds)
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="kvd-transfer-report",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()

    def flush(self) -> None:
        report = self.totals.take()
        if report is None:
            return
        try:
            self._send(self.socket_path, report, self.timeout_s, self.engine_id)
            self.sent_total += 1
        except AttachError as exc:
            if not self._warned:
                log.warning("kvd worker could not report transfers to %s (%s); dropped until "
                            "the daemon answers", self.socket_path, exc.message)
                self._warned = True
            return
        self._warned = False

    def close(self) -> None:
        """Stop the thread and send what is left (one bounded try)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + self.timeout_s * 4)
            self._thread = None
        self.flush()
