"""systemd notify protocol against a fake NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket

import pytest

from kvd_server import notify


@pytest.fixture
def notify_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield sock
    sock.close()


def test_no_socket_is_a_noop(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.ready("x") is False


def test_ready_status_stopping(notify_socket):
    assert notify.ready("serving 1 GiB\npool")
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=serving 1 GiB pool"
    assert notify.status("prefaulting 50%")
    assert notify_socket.recv(4096) == b"STATUS=prefaulting 50%"
    assert notify.stopping("draining")
    assert notify_socket.recv(4096) == b"STOPPING=1\nSTATUS=draining"
    assert notify.watchdog()
    assert notify_socket.recv(4096) == b"WATCHDOG=1"


def test_abstract_socket(monkeypatch):
    name = f"kvd-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(2)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify.ready()
        assert sock.recv(4096) == b"READY=1"
    finally:
        sock.close()


def test_dead_socket_does_not_raise(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "absent.sock"))
    assert notify.ready() is False


def test_watchdog_interval(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert notify.watchdog_interval() == 2.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert notify.watchdog_interval() is None
