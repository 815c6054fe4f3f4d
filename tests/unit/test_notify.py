"""systemd notify protocol against a fake NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket

import pytest

from kvd_server.ops import notify


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


def test_descriptors_go_to_the_store_with_their_name_and_come_back_by_name(notify_socket,
                                                                         monkeypatch):
    r, w = os.pipe()
    try:
        assert notify.store_fds("kvd-pool", [r])
        data, fds, _, _ = socket.recv_fds(notify_socket, 4096, 4)
        assert data == b"FDSTORE=1\nFDNAME=kvd-pool" and len(fds) == 1
        os.write(w, b"k")
        assert os.read(fds[0], 1) == b"k"            # the very pipe, passed along
        os.close(fds[0])
        assert notify.remove_fds("kvd-pool")
        assert notify_socket.recv(4096) == b"FDSTOREREMOVE=1\nFDNAME=kvd-pool"
    finally:
        os.close(r)
        os.close(w)
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert notify.store_fds("x", [0]) is False


def test_listen_fds_are_named_and_only_for_this_process(monkeypatch):
    monkeypatch.setenv("LISTEN_PID", str(os.getpid() + 1))
    monkeypatch.setenv("LISTEN_FDS", "2")
    assert notify.listen_fds() == {}                  # another process's
    assert "LISTEN_FDS" not in os.environ             # consumed either way
    keep = [os.dup(3) if _open(3) else None, os.dup(4) if _open(4) else None]
    r, w = os.pipe()
    try:
        os.dup2(r, 3)
        os.dup2(w, 4)
        monkeypatch.setenv("LISTEN_PID", str(os.getpid()))
        monkeypatch.setenv("LISTEN_FDS", "2")
        monkeypatch.setenv("LISTEN_FDNAMES", "kvd-pool:kvd-pool")
        assert notify.listen_fds() == {"kvd-pool": [3, 4]}
        assert not os.get_inheritable(3)
    finally:
        for fd, saved in zip((3, 4), keep, strict=True):
            if saved is None:
                os.close(fd)
            else:
                os.dup2(saved, fd)
                os.close(saved)
        os.close(r)
        os.close(w)


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
