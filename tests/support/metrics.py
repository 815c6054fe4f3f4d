"""A live daemon's Prometheus endpoint as the tests read it: a free loopback port to serve it
on (`--metrics-port`), one scrape of /metrics, and the value of one sample in a scrape (failing
when the sample is not exposed). Shared by the metrics and transfer-report tests."""

from __future__ import annotations

import re
import socket
import urllib.request


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    """The text of http://127.0.0.1:PORT/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def value(text: str, sample: str) -> float:
    """The value of `sample` (its name and labels, as exposed) in scrape `text`."""
    m = re.search(r"^" + re.escape(sample) + r" (\S+)$", text, re.M)
    assert m, f"{sample} not exposed"
    return float(m.group(1))
